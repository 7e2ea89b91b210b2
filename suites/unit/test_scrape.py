"""Scraping ``/metrics`` over real HTTP and taking deltas with vLLM's metric names."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from bidir_kv.client import HTTPStatusError, scrape
from bidir_kv.scrape import MetricsSnapshot, parse_metrics


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.tokens = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by source",
            ["source", "model_name"],
            registry=self.registry,
        )
        self.failed = Counter(
            "vllm:nixl_num_failed_transfers", "Failed transfers", registry=self.registry
        )
        self.xfer = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Transfer time",
            buckets=(0.001, 0.01, 0.1),
            registry=self.registry,
        )


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, _Metrics]]:
    """A real HTTP server on loopback serving a live Prometheus registry."""
    m = _Metrics()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = generate_latest(m.registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", m
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_scrape_reads_vllm_names_and_labels(metrics_server: tuple[str, _Metrics]) -> None:
    url, m = metrics_server
    m.tokens.labels(source="external_kv_transfer", model_name="tiny").inc(95)
    m.tokens.labels(source="local_compute", model_name="tiny").inc(301)
    m.tokens.labels(source="local_compute", model_name="other").inc(5)
    snap = scrape(url)
    name = "vllm:prompt_tokens_by_source_total"
    assert snap.value(name, source="external_kv_transfer") == 95
    assert snap.value(name, source="local_compute") == 306
    assert snap.value(name, source="local_compute", model_name="tiny") == 301
    assert snap.value(name) == 401
    assert snap.value(name, source="local_cache_hit") == 0
    assert snap.value("vllm:no_such_metric") == 0
    assert name in snap.names()


def test_delta_between_scrapes(metrics_server: tuple[str, _Metrics]) -> None:
    url, m = metrics_server
    m.tokens.labels(source="external_kv_transfer", model_name="tiny").inc(10)
    m.xfer.observe(0.005)
    before = scrape(url)
    m.tokens.labels(source="external_kv_transfer", model_name="tiny").inc(87)
    m.tokens.labels(source="local_cache_hit", model_name="tiny").inc(128)  # new series
    m.failed.inc()
    m.xfer.observe(0.05)
    m.xfer.observe(0.5)
    delta = scrape(url) - before
    assert isinstance(delta, MetricsSnapshot)
    assert delta.value("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 87
    assert delta.value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 128
    assert delta.value("vllm:nixl_num_failed_transfers_total") == 1
    assert delta.value("vllm:nixl_xfer_time_seconds_count") == 2
    assert delta.value("vllm:nixl_xfer_time_seconds_sum") == pytest.approx(0.55)
    assert delta.value("vllm:nixl_xfer_time_seconds_bucket", le="0.1") == 1
    assert delta.value("vllm:nixl_xfer_time_seconds_bucket", le="+Inf") == 2


def test_missing_endpoint_raises(metrics_server: tuple[str, _Metrics]) -> None:
    url, _ = metrics_server
    with pytest.raises(HTTPStatusError) as info:
        scrape(url + "not-here")
    assert info.value.status == 404


def test_parse_metrics_flattens_samples() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="tiny"} 3\n'
        "# TYPE vllm:nixl_num_kv_expired_reqs counter\n"
        "vllm:nixl_num_kv_expired_reqs_total 2\n"
    )
    samples = parse_metrics(text)
    assert samples[("vllm:num_requests_running", (("model_name", "tiny"),))] == 3.0
    assert samples[("vllm:nixl_num_kv_expired_reqs_total", ())] == 2.0
    snap = MetricsSnapshot(samples)
    assert snap.names() == {"vllm:num_requests_running", "vllm:nixl_num_kv_expired_reqs_total"}
    empty = MetricsSnapshot({})
    assert (snap - empty).value("vllm:nixl_num_kv_expired_reqs_total") == 2
    assert (empty - snap).value("vllm:num_requests_running") == -3
