"""Prometheus metrics under the real vLLM / SGLang names."""

from __future__ import annotations

import threading
import time

from .settings import DATA


class Histogram:
    def __init__(self):
        self.buckets = DATA["histogram_buckets"]
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.n += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        pairs = zip(self.buckets, self.counts, strict=True)
        out = [f'{name}_bucket{{{labels},le="{b}"}} {c}' for b, c in pairs]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.n}"]
        return out


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.started = time.time()

    def begin(self) -> float:
        with self.lock:
            self.running += 1
        return time.time()

    def end(self, start: float, prompt: int, generated: int, reason: str | None) -> None:
        """Count a finished request (reason None: rejected before it ran)."""
        now = time.time()
        with self.lock:
            self.running -= 1
            if reason is None:
                return
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.ttft.observe(now - start)  # the stand-in answers in one go
            self.e2e.observe(now - start)

    def render(self, engine: str, model: str) -> str:
        with self.lock:
            return "\n".join(self._vllm(model) if engine == "vllm" else self._sglang(model)) + "\n"

    def _usage(self) -> float:
        return min(self.running * 0.01, 1.0)

    def _vllm(self, model: str) -> list[str]:
        lab = f'engine="0",model_name="{model}"'
        out = []
        for name, kind, help_, value in (
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution "
             "batches.", self.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be "
             "processed.", 0),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             self._usage()),
            ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent "
             "usage.", self._usage()),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             self.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens "
             "processed.", self.generation_tokens),
        ):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                    f"{name}{{{lab}}} {float(value)}"]
        out += ["# HELP vllm:request_success_total Count of successfully processed requests.",
                "# TYPE vllm:request_success_total counter"]
        for reason in ("stop", "length", "abort"):
            out.append(f'vllm:request_success_total{{{lab},finished_reason="{reason}"}} '
                       f"{float(self.finished.get(reason, 0))}")
        for name, hist, help_ in (
            ("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token "
             "in seconds."),
            ("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency "
             "in seconds."),
        ):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
            out += hist.lines(name, lab)
        return out

    def _sglang(self, model: str) -> list[str]:
        lab = f'model_name="{model}",engine_type="unified",tp_rank="0",pp_rank="0"'
        elapsed = max(time.time() - self.started, 1e-6)
        out = []
        for name, kind, help_, value in (
            ("sglang:num_running_reqs", "gauge", "The number of running requests.",
             self.running),
            ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
             0),
            ("sglang:num_used_tokens", "gauge", "The number of used tokens.", self.running),
            ("sglang:token_usage", "gauge", "The token usage.", self._usage()),
            ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).",
             self.generation_tokens / elapsed),
            ("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", 0.0),
            ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             self.prompt_tokens),
            ("sglang:generation_tokens_total", "counter", "Number of generation tokens "
             "processed.", self.generation_tokens),
            ("sglang:num_requests_total", "counter", "Number of requests processed.",
             sum(self.finished.values())),
        ):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                    f"{name}{{{lab}}} {float(value)}"]
        for name, hist, help_ in (
            ("sglang:time_to_first_token_seconds", self.ttft, "Histogram of time to first "
             "token in seconds."),
            ("sglang:e2e_request_latency_seconds", self.e2e, "Histogram of End-to-end request "
             "latency in seconds"),
        ):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
            out += hist.lines(name, lab)
        return out
