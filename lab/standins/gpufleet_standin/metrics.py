"""Prometheus metrics under the real vLLM / SGLang names.

What is exposed (name, type, help, labels, histogram buckets) is data, metrics.json, read
from the real wheels; this module feeds it from the stand-in's requests and writes the text
format (0.0.4) as prometheus_client does. Series are kept for both engines; /metrics shows
the one the process runs as.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

from .model import RequestError
from .settings import METRICS

ENGINES = METRICS["engines"]
MODEL = "{served_model_name}"  # label value placeholder in metrics.json
FINISH = {"tool_calls": "stop"}  # OpenAI finish reason -> the engine's own


def _num(value: float) -> str:
    """A float as prometheus_client writes it (its floatToGoString)."""
    value = float(value)
    if value == float("inf"):
        return "+Inf"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go writes exponents sooner than Python
        return f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.") + f"e+0{dot - 1}"
    return text


def _per_request(metric: dict) -> list[str]:
    """The metric's labels whose value comes from each request (a list in metrics.json)."""
    return [k for k, v in metric["labels"].items() if isinstance(v, list)]


class Histogram:
    def __init__(self, bounds: list[float]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # cumulative, as exposed
        self.sum = 0.0
        self.n = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.sum += value * times
        self.n += times
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += times

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels},le="{_num(b)}"}} {_num(c)}'
               for b, c in zip(self.bounds, self.counts, strict=True)]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {_num(self.n)}')
        return out + [f"{name}_count{{{labels}}} {_num(self.n)}",
                      f"{name}_sum{{{labels}}} {_num(self.sum)}"]


def _engine_failure() -> str | None:
    """The reason of a request that end() gets with reason None: "error" while a failure
    inside the engine unwinds (a 5xx RequestError: KV transfer failed, engine core fault),
    None when it was rejected before it ran (4xx: bad request, too long), which the real
    engines do not count."""
    exc = sys.exc_info()[1]
    failed = isinstance(exc, RequestError) and len(exc.args) > 1 and exc.args[1] >= 500
    return "error" if failed else None


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0  # the stand-in has no queue of its own (see end(queued=))
        self.generated = 0
        self.started = time.monotonic()
        # engine -> metric name -> per-request label values -> counter value or Histogram
        self.series: dict[str, dict[str, dict[tuple, object]]] = {
            engine: {m["name"]: {} for m in spec["metrics"]} for engine, spec in ENGINES.items()}
        for engine, spec in ENGINES.items():
            for m in spec["metrics"]:
                if spec["series_from_start"] and m["type"] != "gauge":
                    for values in itertools.product(*(m["labels"][k] for k in _per_request(m))):
                        self._series(engine, m, values)

    def _series(self, engine: str, metric: dict, values: tuple):
        store = self.series[engine][metric["name"]]
        if values not in store:
            store[values] = Histogram(metric["buckets"]) if metric["type"] == "histogram" else 0
        return store[values]

    def begin(self) -> float:
        with self.lock:
            self.running += 1
        return time.monotonic()

    def end(self, start: float, prompt: int, generated: int, reason: str | None, *,
            stream: bool = False, queued: float = 0.0) -> None:
        """Count a finished request: reason is the finish reason (stop, length, tool_calls;
        "error" for a failure in the engine); None: rejected before it ran, or failed (see
        _engine_failure). stream: it was streamed; queued: seconds it waited for a slot.

        The stand-in produces all tokens and then answers at once; its time is shared out
        as the GPU it paces would (GPUFLEET_LAB_STEP_MS: one token per step): the first
        token one step after the queue, then one step between tokens."""
        now = time.monotonic()
        with self.lock:
            self.running -= 1
            reason = reason or _engine_failure()
            if reason is None:
                return
            error = reason == "error"
            e2e = now - start
            step = max(e2e - queued, 0.0) / max(generated, 1)
            labels = {"finished_reason": FINISH.get(reason, reason),
                      "is_streaming": "true" if stream else "false"}
            counts = {"prompt_tokens": prompt, "generation_tokens": generated, "requests": 1,
                      "preemptions": 0, **({"errors": 1} if error else {})}
            observed = {"e2e": (e2e, 1), "queue": (queued, 1)}
            if generated and not error:
                observed["ttft"] = (queued + step, 1)
            if generated > 1:
                observed["itl"] = (step, generated - 1)
            self.generated += generated
            for engine, spec in ENGINES.items():
                for m in spec["metrics"]:
                    values = tuple(labels[k] for k in _per_request(m))
                    if m["type"] == "counter" and m["value"] in counts:
                        store = self.series[engine][m["name"]]
                        store[values] = self._series(engine, m, values) + counts[m["value"]]
                    elif m["type"] == "histogram" and m["value"] in observed:
                        self._series(engine, m, values).observe(*observed[m["value"]])

    def _gauges(self) -> dict[str, float]:
        usage = min(self.running * 0.01, 1.0)
        return {"running": self.running, "waiting": self.waiting, "kv_usage": usage,
                "used_tokens": self.running, "cache_hit_rate": 0.0, "preemptions": 0,
                "gen_throughput": self.generated / max(time.monotonic() - self.started, 1e-6)}

    def render(self, engine: str, model: str) -> str:
        out = []
        with self.lock:
            gauges = self._gauges()
            for m in ENGINES[engine]["metrics"]:
                name, kind = m["name"], m["type"]
                out += [f"# HELP {name} {m['help']}", f"# TYPE {name} {kind}"]
                if kind == "gauge":
                    out.append(f"{name}{{{_labels(m, (), model)}}} {_num(gauges[m['value']])}")
                for values, value in self.series[engine][name].items():  # none for gauges
                    labels = _labels(m, values, model)
                    out += (value.lines(name, labels) if kind == "histogram"
                            else [f"{name}{{{labels}}} {_num(value)}"])
        return "\n".join(out) + "\n"


def _labels(metric: dict, values: tuple, model: str) -> str:
    """name="value",... in the metric's label order; per-request values from `values`."""
    it = iter(values)
    pairs = ((k, next(it) if isinstance(v, list) else v.replace(MODEL, model))
             for k, v in metric["labels"].items())
    return ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
