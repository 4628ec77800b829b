"""Every Ansible module and lookup plugin documents itself (DOCUMENTATION, EXAMPLES, RETURN)
as its code behaves: a module's options are its argument_spec, its examples call it with
them, its RETURN names what it returns; the gpufleet_plan lookup names every variable the
planner reads from the inventory, with fab's command-line options. Read from the sources
(ast), never imported: the modules run on the hosts, with Ansible's module_utils."""

from __future__ import annotations

import ast
import contextlib
import re
from pathlib import Path

import pytest
import yaml
from ansible.playbook.task import Task

from gpufleet import cli

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "gpufleet"
PLUGINS = PACKAGE / "ansible_plugins"
MODULES = sorted(p for p in (PLUGINS / "modules").glob("*.py") if not p.name.startswith("_"))
LOOKUPS = sorted(p for p in (PLUGINS / "lookup").glob("*.py") if not p.name.startswith("_"))
DOCS = ("DOCUMENTATION", "EXAMPLES", "RETURN")
COLLECTION = "gpufleet.fleet."  # galaxy.yml: the examples call the plugins by full name
# what a task may carry besides its module: Ansible's own task keywords (and with_* loops)
TASK_KEYWORDS = set(Task.fattributes)
# keywords every lookup call takes, whatever the plugin
LOOKUP_KEYWORDS = {"errors", "wantlist", "allow_unsafe"}
# Ansible's defaults for an option that does not say
OPTION_DEFAULTS = {"type": "str", "required": False, "default": None, "choices": None,
                   "elements": None}


def ids(paths):
    return [f"{p.parent.name}/{p.stem}" for p in paths]


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def doc_strings(path: Path) -> dict[str, str]:
    """The plugin's module-level DOCUMENTATION, EXAMPLES and RETURN strings."""
    found = {}
    for node in tree(path).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id in DOCS
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            found[node.targets[0].id] = node.value.value
    return found


def docs(path: Path) -> dict:
    """DOCUMENTATION, EXAMPLES and RETURN parsed as YAML."""
    return {name: yaml.safe_load(text) for name, text in doc_strings(path).items()}


def constants(module: ast.Module) -> dict[str, object]:
    """Module-level names bound to values `literal` can evaluate (ALL = [...])."""
    names: dict[str, object] = {}
    for node in module.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError):
                names[node.targets[0].id] = literal(node.value, names)
    return names


def literal(node: ast.AST, names: dict[str, object]):
    """A literal, a dict(...) call or a module-level constant; ValueError for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {literal(k, names): literal(v, names) for k, v in zip(node.keys, node.values,
                                                                      strict=True)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e, names) for e in node.elts]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "dict" and not node.args:
        return {k.arg: literal(k.value, names) for k in node.keywords if k.arg}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -literal(node.operand, names)
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    raise ValueError(ast.unparse(node))


def argument_spec(path: Path) -> dict:
    """The argument_spec the module hands AnsibleModule."""
    module = tree(path)
    names = constants(module)
    for node in ast.walk(module):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(
                node.func, "attr", None)) == "AnsibleModule":
            for keyword in node.keywords:
                if keyword.arg == "argument_spec":
                    return literal(keyword.value, names)
    raise AssertionError(f"{path.name}: no AnsibleModule(argument_spec=...) call")


def result_keys(path: Path) -> set[str]:
    """The keywords the module passes exit_json and fail_json (changed and msg aside)."""
    keys = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
                "exit_json", "fail_json"):
            keys |= {k.arg for k in node.keywords if k.arg}
    return keys - {"changed", "msg"}


def scan(text: str, start: int = 0, depth: int = 0):
    """(index, character, bracket depth) of each character outside quotes from start."""
    quote = None
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        yield i, ch, depth


def lookup_calls(text: str, name: str) -> list[str]:
    """The argument text of each lookup('name', ...) or query('name', ...) in text."""
    calls = []
    for match in re.finditer(r"\b(?:lookup|query|q)\(\s*(['\"])" + re.escape(name) + r"\1",
                             text):
        end = next((i for i, _, depth in scan(text, match.end(), 1) if depth == 0), len(text))
        calls.append(text[match.end():end])
    return calls


def strings_in(value) -> list[str]:
    """Every string in a task, its keys and nested values included."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings_in(k) + strings_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return [value] if isinstance(value, str) else []


def top_level_keywords(arguments: str) -> set[str]:
    """The name=value keywords of a call's argument text (not those of nested calls)."""
    found = set()
    for i, ch, depth in scan(arguments):
        if ch == "=" and depth == 0 and arguments[i + 1:i + 2] != "=" \
                and arguments[i - 1:i] not in ("=", "!", "<", ">"):
            word = re.search(r"(\w+)\s*$", arguments[:i])
            if word:
                found.add(word.group(1))
    return found


# --------------------------------------------------------------------------- every plugin

@pytest.mark.parametrize("path", MODULES + LOOKUPS, ids=ids(MODULES + LOOKUPS))
def test_docs_are_present_and_yaml(path):
    texts = doc_strings(path)
    missing = [name for name in DOCS if not (texts.get(name) or "").strip()]
    assert not missing, f"{path.name} has no (or an empty) {', '.join(missing)}"
    for name, text in texts.items():
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            pytest.fail(f"{path.name} {name} is not YAML: {exc}")
        assert parsed, f"{path.name} {name} is empty"
    parsed = docs(path)
    doc = parsed["DOCUMENTATION"]
    assert isinstance(doc, dict), f"{path.name} DOCUMENTATION is not a mapping"
    kind = "module" if path in MODULES else "name"
    assert doc.get(kind) == path.stem, f"{path.name} DOCUMENTATION {kind}: {doc.get(kind)!r}"
    assert doc.get("short_description"), f"{path.name} has no short_description"
    assert doc.get("description"), f"{path.name} has no description"
    for option, spec in (doc.get("options") or {}).items():
        assert (spec or {}).get("description"), f"{path.name} option {option}: no description"
    examples = parsed["EXAMPLES"]
    assert isinstance(examples, list) and all(isinstance(t, dict) for t in examples), \
        f"{path.name} EXAMPLES is not a list of tasks"
    for task in examples:
        assert task.get("name"), f"{path.name}: an example task without a name: {task}"
    returned = parsed["RETURN"]
    assert isinstance(returned, dict), f"{path.name} RETURN is not a mapping"
    for key, spec in returned.items():
        assert (spec or {}).get("description") and spec.get("type"), \
            f"{path.name} RETURN {key}: needs a description and a type"
        if path in MODULES:
            assert spec.get("returned"), f"{path.name} RETURN {key}: say when it is returned"


# --------------------------------------------------------------------------- modules

@pytest.mark.parametrize("path", MODULES, ids=ids(MODULES))
def test_module_options_are_its_argument_spec(path):
    documented = docs(path)["DOCUMENTATION"].get("options") or {}
    spec = argument_spec(path)
    assert set(documented) == set(spec), (
        f"{path.name}: DOCUMENTATION options and argument_spec differ: documented only "
        f"{sorted(set(documented) - set(spec))}, in argument_spec only "
        f"{sorted(set(spec) - set(documented))}")
    for option, code in spec.items():
        for field, default in OPTION_DEFAULTS.items():
            want = code.get(field, default)
            have = documented[option].get(field, default)
            if field == "choices" and want is not None:
                want, have = list(want), list(have or [])
            assert have == want, (f"{path.name} option {option}: DOCUMENTATION says "
                                  f"{field}={have!r}, argument_spec {want!r}")


@pytest.mark.parametrize("path", MODULES, ids=ids(MODULES))
def test_module_examples_call_it_with_its_options(path):
    parsed = docs(path)
    options = parsed["DOCUMENTATION"].get("options") or {}
    required = {name for name, spec in options.items() if spec.get("required")}
    fqcn = COLLECTION + path.stem  # as a site's playbook calls it
    for task in parsed["EXAMPLES"]:
        others = {k for k in task if k not in TASK_KEYWORDS and not k.startswith("with_")}
        assert others == {fqcn}, (
            f"{path.name}: example {task.get('name')!r} calls {sorted(others) or 'nothing'}, "
            f"not {fqcn}")
        args = task[fqcn] or {}
        assert isinstance(args, dict), f"{path.name}: example {task['name']!r}: args as a mapping"
        unknown = sorted(set(args) - set(options))
        assert not unknown, (f"{path.name}: example {task['name']!r} passes {unknown}, which "
                             "DOCUMENTATION does not declare")
        absent = sorted(required - set(args))
        assert not absent, f"{path.name}: example {task['name']!r} lacks required {absent}"
        for name, value in args.items():
            choices = options[name].get("choices")
            values = value if isinstance(value, list) else [value]
            if choices and not any("{{" in str(v) for v in values):
                assert set(values) <= set(choices), (
                    f"{path.name}: example {task['name']!r}: {name}={value!r} is none of "
                    f"{choices}")


@pytest.mark.parametrize("path", MODULES, ids=ids(MODULES))
def test_module_return_names_what_it_returns(path):
    documented = set(docs(path)["RETURN"])
    missing = sorted(result_keys(path) - documented)
    assert not missing, f"{path.name} returns {missing}, which RETURN does not describe"


# --------------------------------------------------------------------------- lookups

def lookup_options_in_code(path: Path) -> set[str]:
    """What the lookup reads as options: run()'s keyword parameters and get_option("...")."""
    found = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.FunctionDef) and node.name == "run":
            params = node.args.args + node.args.kwonlyargs
            found |= {a.arg for a in params} - {"self", "terms", "variables"}
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get_option" \
                and node.args and isinstance(node.args[0], ast.Constant):
            found.add(node.args[0].value)
    return found


@pytest.mark.parametrize("path", LOOKUPS, ids=ids(LOOKUPS))
def test_lookup_options_are_what_it_reads(path):
    documented = set(docs(path)["DOCUMENTATION"].get("options") or {}) - {"_terms"}
    used = lookup_options_in_code(path)
    assert documented == used, (f"{path.name}: DOCUMENTATION options {sorted(documented)}, "
                                f"the code reads {sorted(used)}")


@pytest.mark.parametrize("path", LOOKUPS, ids=ids(LOOKUPS))
def test_lookup_examples_call_it_with_its_options(path):
    parsed = docs(path)
    options = set(parsed["DOCUMENTATION"].get("options") or {}) | LOOKUP_KEYWORDS
    for task in parsed["EXAMPLES"]:
        fqcn = COLLECTION + path.stem
        calls = [c for text in strings_in(task) for c in lookup_calls(text, fqcn)]
        assert calls, f"{path.name}: example {task['name']!r} does not call lookup('{fqcn}')"
        for arguments in calls:
            unknown = sorted(top_level_keywords(arguments) - options)
            assert not unknown, (f"{path.name}: example {task['name']!r} passes {unknown}, "
                                 "which DOCUMENTATION does not declare")


# --------------------------------------------------------------------------- gpufleet_plan

PLAN_LOOKUP = PLUGINS / "lookup" / "gpufleet_plan.py"
# named in the description, read by playbooks/plan.yml rather than the planner
NOT_READ_BY_THE_PLANNER = {"gpufleet_plan_json"}


def imported_files(path: Path) -> set[Path]:
    """The gpufleet source files path imports (from gpufleet..., from .)."""
    out = set()
    package = path.parent
    for node in ast.walk(tree(path)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package
            for _ in range(node.level - 1):
                base = base.parent
            parts = (node.module or "").split(".") if node.module else []
        elif node.module and (node.module == "gpufleet" or node.module.startswith("gpufleet.")):
            base, parts = REPO, node.module.split(".")
        else:
            continue
        target = base.joinpath(*parts)
        candidates = [target.with_suffix(".py"), target / "__init__.py"]
        candidates += [target / f"{alias.name}.py" for alias in node.names]
        candidates += [target / alias.name / "__init__.py" for alias in node.names]
        out |= {c.resolve() for c in candidates if c.is_file()}
    return out


def planner_files() -> set[Path]:
    """The lookup and every gpufleet module it reaches through its imports."""
    seen, todo = set(), [PLAN_LOOKUP.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [p for p in imported_files(path) if PACKAGE.resolve() in p.parents]
    return seen


def variables_read(path: Path) -> set[str]:
    """gpufleet_* names the code reads by name: X.get("gpufleet_...") and X["gpufleet_..."]."""
    found = set()
    for node in ast.walk(tree(path)):
        key = None
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" \
                and node.args and isinstance(node.args[0], ast.Constant):
            key = node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        if isinstance(key, str) and re.fullmatch(r"gpufleet_\w+", key):
            found.add(key)
    return found


def planner_variables() -> set[str]:
    """Every inventory variable the planner reads: the overrides cli.INVENTORY_OVERRIDES
    maps onto Overrides, and those the lookup and the code behind it read by name
    (gpufleet_target, gpufleet_deployment, a host's gpufleet_hardware, ...)."""
    found = set(cli.INVENTORY_OVERRIDES)
    for path in planner_files():
        found |= variables_read(path)
    return found


def plan_description() -> str:
    description = docs(PLAN_LOOKUP)["DOCUMENTATION"]["description"]
    return "\n".join(description if isinstance(description, list) else [description])


def test_planner_variables_are_found():
    """The derivation itself: the override map and the names read in cli, inventory, plan."""
    found = planner_variables()
    assert set(cli.INVENTORY_OVERRIDES) <= found
    assert {"gpufleet_target", "gpufleet_internal_address", "gpufleet_deployment"} <= found
    assert PACKAGE / "plan.py" in planner_files()


def test_fab_knows_every_variable_the_planner_reads():
    """cli.PLAN_VARIABLES (fab refuses them in -e) is what the code reads."""
    assert set(cli.PLAN_VARIABLES) == planner_variables()


def test_plan_lookup_documents_every_variable_the_planner_reads():
    documented = set(re.findall(r"C\((gpufleet_\w+)\)", plan_description()))
    missing = sorted(planner_variables() - documented)
    assert not missing, ("the planner reads these inventory variables, which the "
                         f"gpufleet_plan lookup's DOCUMENTATION does not describe: {missing}")
    stale = sorted(documented - planner_variables() - NOT_READ_BY_THE_PLANNER)
    assert not stale, f"gpufleet_plan documents variables the planner does not read: {stale}"


def test_plan_lookup_names_fabs_options():
    """fab plan's options that change the plan (tasks.py `plan`, less -i and --format)."""
    fab = tree(REPO / "gpufleet" / "tasks.py")
    plan = next(n for n in fab.body if isinstance(n, ast.FunctionDef) and n.name == "plan")
    flags = {"--" + a.arg.rstrip("_").replace("_", "-") for a in plan.args.args[1:]
             if a.arg not in ("inventory", "format")}
    assert {"--target", "--with", "--set", "--unset", "--runtime"} <= flags
    text = plan_description()
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"\b", text))
    assert not missing, f"gpufleet_plan's DOCUMENTATION does not name fab's {missing}"
