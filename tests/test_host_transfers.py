"""Host offload in the time model: what a compiled step moves between device and host
memory (``workbench.perf._host``), checked against a hand count on a small offloaded TPU
compile, and the "host transfers" term it adds to the predicted step.

The model: GPT "tiny" (2 layers, d_model 64, 4 query heads and 2 key/value heads of 16),
remat ``qkvo_input_offloaded`` (MaxText's Llama-3.1-8B v6e policy: the block input and
the q/k/v/out projections go to host memory after the forward pass and come back for the
backward), on a v5e-4 slice, data-parallel, one 128-token sequence per chip. Per chip and
layer that is, in bfloat16: the input 128 x 64, q 128 x 4 x 16, out 128 x 64 (16 KiB
each), k and v 128 x 2 x 16 (8 KiB each): 64 KiB per layer, 128 KiB per step, each way.
Compiled once with its layers scanned (the TPU compiler writes each layer's slices into
stacked host buffers: ``dynamic-update-slice-start`` / ``dynamic-slice-start``) and once
unscanned (whole arrays: ``copy-start`` to and from ``S(5)``).

The scanned program moves more than the hand count, and the reading says so exactly: libtpu
0.0.50.1 unrolls the two-layer scan and writes both layers' slices into the stacked host
buffers (10 ``dynamic-update-slice-start``, indices 0 and 1), but reads back only layer 0's
(5 ``dynamic-slice-start`` at index 0); the last layer, whose backward pass comes first,
makes a round trip of its own instead (5 ``copy-start`` to ``S(5)`` and 5 back). So its five
tensors go to the host twice (the stacked slice is a dead store): 192 KiB to the host, 128
KiB back, where the hand count says 128 each way. libtpu 0.0.42 issued the hand count. The
plan counts what the compiler issues (its time term reads the same transfers).
"""
import pytest

import workbench as wb
from workbench.hardware import GENERATIONS, hardware_spec
from workbench.models import GPTConfig
from workbench.perf._host import HostTraffic, host_seconds, host_traffic
from _tpu import tpu





TINY = GPTConfig.preset("tiny")
TOKENS_PER_CHIP = 128            # batch 4 over 4 chips, seq 128
KIB = 1024


def _hand_count(cfg: GPTConfig) -> dict[str, int]:
    """Bytes per chip per step each way, from the shapes: the offloaded tensors' widths
    (per token) x tokens per chip x layers x 2 bytes (bfloat16)."""
    widths = {"decoder_layer_input": cfg.d_model,
              "query_proj": cfg.n_heads * cfg.head_dim,
              "key_proj": cfg.n_kv_heads * cfg.head_dim,
              "value_proj": cfg.n_kv_heads * cfg.head_dim,
              "out_proj": cfg.d_model}
    return {name: w * TOKENS_PER_CHIP * cfg.n_layers * 2 for name, w in widths.items()}


def test_the_hand_count_itself():
    counts = _hand_count(TINY)
    assert counts == {"decoder_layer_input": 32 * KIB, "query_proj": 32 * KIB,
                      "key_proj": 16 * KIB, "value_proj": 16 * KIB, "out_proj": 32 * KIB}
    assert sum(counts.values()) == 128 * KIB


def _expected(cfg: GPTConfig, scanned: bool) -> tuple[int, int]:
    """(to host, to device) bytes per chip per step: the hand count, and for the scanned
    program the last layer's tensors once more to the host (module docstring)."""
    hand = sum(_hand_count(cfg).values())
    return (hand + hand // cfg.n_layers if scanned else hand), hand


@pytest.fixture(scope="module", params=[True, False], ids=["scanned", "unscanned"])
def offloaded(request):
    return wb.plan(TINY.replace(remat="qkvo_input_offloaded", scan_layers=request.param),
                   mesh=wb.abstract_mesh("v5e-4", data=-1), batch=4, seq=128,
                   progress=False)


@tpu
def test_reading_matches_the_hand_count(offloaded):
    assert offloaded.source == "tpu-compiler"
    scanned = offloaded.cfg.scan_layers
    traffic = host_traffic(offloaded.compiled.as_text())
    assert sum(_hand_count(TINY).values()) == 128 * KIB
    up, down = _expected(TINY, scanned)
    assert (traffic.to_host_bytes, traffic.to_device_bytes) == (up, down)
    assert (up, down) == ((192 if scanned else 128) * KIB, 128 * KIB)
    assert all(t.asynchronous for t in traffic.transfers)
    # one layer's five tensors: q and the two d_model-wide ones 16 KiB, k and v 8 KiB
    layer = [16 * KIB] * 3 + [8 * KIB] * 2
    by_op: dict[tuple[str, str], list[int]] = {}
    for t in traffic.transfers:
        by_op.setdefault((t.op, t.direction), []).append(t.bytes)
    by_op = {k: sorted(v) for k, v in by_op.items()}
    if scanned:   # both layers into the stacked buffers, layer 0 back; the last layer's round trip
        assert by_op == {("dynamic-update-slice-start", "to_host"): sorted(layer * 2),
                         ("dynamic-slice-start", "to_device"): sorted(layer),
                         ("copy-start", "to_host"): sorted(layer),
                         ("copy-start", "to_device"): sorted(layer)}
    else:         # each layer's five tensors, one transfer each way
        assert by_op == {("copy-start", "to_host"): sorted(layer * 2),
                         ("copy-start", "to_device"): sorted(layer * 2)}


@tpu
def test_the_time_term(offloaded):
    """The link's time is the bytes at the bandwidth; what is exposed lies between
    nothing (all hidden) and both directions end to end, and at least the busier
    direction's transfers minus all the compute there is to hide them behind."""
    traffic = host_traffic(offloaded.compiled.as_text())
    spec = hardware_spec("v5e")
    up, down = traffic.to_host_bytes, traffic.to_device_bytes
    for bw in (1e6, 1e9, spec.host_bandwidth, 1e15):
        t = host_seconds(traffic, bandwidth=bw, clock_hz=spec.clock_hz)
        assert t.link_seconds == pytest.approx(max(up, down) / bw)
        assert 0.0 <= t.exposed_seconds <= (up + down) / bw * (1 + 1e-9)
        assert t.hidden_seconds == pytest.approx(max(0.0, t.link_seconds - t.exposed_seconds))
    cycles, _ = offloaded.report.compiler_cycles
    slow = host_seconds(traffic, bandwidth=1e6, clock_hz=spec.clock_hz)
    # the two directions may cross at once (full duplex): at least the busier one's
    assert slow.exposed_seconds >= max(up, down) / 1e6 - cycles / spec.clock_hz
    fast = host_seconds(traffic, bandwidth=1e15, clock_hz=spec.clock_hz)
    assert fast.exposed_seconds < 1e-9


@tpu
def test_the_prediction_has_a_host_transfers_term(offloaded):
    """The plan's prediction adds the exposed host transfers at the catalogue's host-link
    bandwidth, says so, and carries the bytes."""
    pred = offloaded.predicted
    b = pred.breakdown
    spec = hardware_spec("v5e")
    traffic = host_traffic(offloaded.compiled.as_text())
    assert traffic == offloaded.report.host_traffic
    # the splash kernels' time (the local work beyond the compiler's cycles), spread over
    # their calls, is compute the transfers can hide behind
    cycles, _ = offloaded.report.compiler_cycles
    per_call = (b["local"] - cycles / spec.clock_hz) / traffic.kernel_calls
    own = host_seconds(traffic, bandwidth=spec.host_bandwidth, clock_hz=spec.clock_hz,
                       kernel_seconds=per_call)
    assert b["host_transfers"] == pytest.approx(own.exposed_seconds)
    assert b["host_link"] == pytest.approx(own.link_seconds)
    assert (b["host_bytes_to_host"], b["host_bytes_to_device"]) == _expected(
        TINY, offloaded.cfg.scan_layers)
    assert pred.step_seconds == pytest.approx(
        b["local"] + b["communication"] + b["host_transfers"])
    assert "host-link" in pred.sources["host_transfers"]
    assert spec.source_of("host_bandwidth") in pred.sources["host_transfers"]
    assert "host transfers" in str(pred)
    assert pred.to_dict()["breakdown"]["host_transfers"] == b["host_transfers"]


@tpu
def test_no_offload_no_host_term():
    kept = wb.plan(TINY.replace(remat="minimal"), mesh=wb.abstract_mesh("v5e-4", data=-1),
                   batch=4, progress=False)
    assert not host_traffic(kept.compiled.as_text())
    b = kept.predicted.breakdown
    assert b["host_transfers"] == 0.0 and b["host_bytes_to_host"] == 0


# -- without a compiler: the walk of a schedule, by hand ------------------------------------

def _traffic(events, count=1, up=0, down=0):
    from workbench.perf._host import HostTransfer

    transfers = [HostTransfer(name=f"t{i}", computation="c", op="copy-start",
                              direction=d, bytes=b, count=count, asynchronous=True,
                              shape="bf16[1]")
                 for i, (d, b) in enumerate([("to_host", up), ("to_device", down)]) if b]
    return HostTraffic(transfers=tuple(transfers),
                       schedule={"c": {"count": count, "events": events}})


def test_walk_hides_a_transfer_behind_the_compute_between_start_and_done():
    # 100 B at 10 B/s = 10 s; 4e9 cycles at 1 GHz = 4 s between start and done: 6 s exposed
    t = host_seconds(_traffic([["s", "a", "to_host", 100], ["c", 4e9, 0], ["d", "a"]],
                              up=100), bandwidth=10.0, clock_hz=1e9)
    assert t.exposed_seconds == pytest.approx(6.0)
    assert t.link_seconds == pytest.approx(10.0) and t.hidden_seconds == pytest.approx(4.0)
    # enough compute: nothing exposed; a loop body counts once per run (count)
    t = host_seconds(_traffic([["s", "a", "to_host", 100], ["c", 20e9, 0], ["d", "a"]],
                              up=100, count=3), bandwidth=10.0, clock_hz=1e9)
    assert t.exposed_seconds == 0.0 and t.link_seconds == pytest.approx(30.0)


def test_walk_one_queue_per_direction_and_kernels_count_as_compute():
    # two to_host transfers share the queue (second ends at 20 s); a to_device one runs
    # beside them (ends at 10 s); 2 kernel calls of 3 s = 6 s of compute before the dones
    ev = [["s", "a", "to_host", 100], ["s", "b", "to_host", 100],
          ["s", "c", "to_device", 100], ["c", 0, 2], ["d", "c"], ["d", "a"], ["d", "b"]]
    t = host_seconds(_traffic(ev, up=200, down=100), bandwidth=10.0, clock_hz=1e9,
                     kernel_seconds=3.0)
    assert t.exposed_seconds == pytest.approx(20.0 - 6.0)
    # a synchronous transfer waits in full
    t = host_seconds(_traffic([["c", 1e9, 0], ["x", "to_host", 50]], up=50),
                     bandwidth=10.0, clock_hz=1e9)
    assert t.exposed_seconds == pytest.approx(5.0)


def test_traffic_round_trips_through_json():
    import json

    tr = _traffic([["s", "a", "to_host", 100], ["c", 5, 1], ["d", "a"]], up=100)
    back = HostTraffic.from_dict(json.loads(json.dumps(tr.to_dict())))
    assert back == tr and not HostTraffic.from_dict(None)


def test_catalogue_has_a_sourced_host_link_for_each_generation():
    for name in ("v4", "v5e", "v5p", "v6e", "H100", "H200"):
        spec = next(g for g in GENERATIONS if g.name == name).spec
        assert spec.host_bandwidth and spec.host_bandwidth > 1e9, name
        assert spec.source_of("host_bandwidth") != "unknown", name
    # the scaling book's figures: 1.5e10 B/s per chip, Trillium 32 GB/s
    assert hardware_spec("v5p").host_bandwidth == hardware_spec("v5e").host_bandwidth == 1.5e10
    assert hardware_spec("v6e").host_bandwidth == 3.2e10
