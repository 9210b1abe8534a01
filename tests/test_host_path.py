"""The host path of a step (issue 18): what the runtime asks of the device per write and download,
and the executor's and capture session's steady-state caches, each with the guarantee it keeps."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from lockstep.golden.anchors import MODEL_DIR
from lockstep.kernels import primitives as P
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.errors import DeviceAssert
from lockstep.reference_runtime.executor import Executor, FeedError
from onnx import TensorProto, helper, numpy_helper


class _Calls:
    """Counts the device calls a runtime makes through its streams and device (instance spies)."""

    def __init__(self, monkeypatch, rt):
        self.n: dict[str, int] = {}
        dev, compute, copy = rt.device, rt._res.compute, rt._res.copy
        for obj, name, label in ((dev, "event", "event"), (compute, "record", "compute.record"),
                                 (compute, "wait", "compute.wait"), (copy, "record", "copy.record"),
                                 (copy, "wait", "copy.wait"), (dev, "memcpy_dtoh", "dtoh"),
                                 (dev, "memcpy_dtoh_many", "dtoh_many")):
            monkeypatch.setattr(obj, name, self._spy(getattr(obj, name), label))

    def _spy(self, real, label):
        def spy(*a, **k):
            self.n[label] = self.n.get(label, 0) + 1
            return real(*a, **k)
        return spy

    def take(self) -> dict[str, int]:
        out, self.n = self.n, {}
        return out


def test_a_write_orders_after_queued_compute_work_and_only_then(device_name, make_runtime, monkeypatch):
    """Guarantee (Runtime.write): a write is ordered after queued compute work that may read the
    tensor and before compute work enqueued later. Contract of the host path: no event is created
    per write (one ordering event is re-recorded: a wait takes the record before it), and a write
    with nothing enqueued on compute since both streams were drained orders nothing before the copy
    (one record and one wait: compute after the copy), where one after queued work orders both."""
    rt = make_runtime()
    x = rt.upload(np.zeros(4, np.float32))
    acc = rt.upload(np.zeros(4, np.float32))
    rt.download(acc)  # drained
    calls = _Calls(monkeypatch, rt)

    rt.write(x, np.full(4, 2.0, np.float32))  # nothing queued on compute since the drain
    assert calls.take() == {"copy.record": 1, "compute.wait": 1}, "contract: no wait for an idle compute stream"
    rt.launch(P.accumulate, acc, x)  # acc += 2, queued, reads x
    rt.write(x, np.full(4, 5.0, np.float32))  # must not overtake the queued reader
    assert calls.take() == {"compute.record": 1, "copy.wait": 1, "copy.record": 1, "compute.wait": 1}, \
        "contract: a write after queued compute work waits for it"
    rt.launch(P.accumulate, acc, x)  # acc += 5: sees the write
    assert rt.download(acc).tolist() == [7.0] * 4, "result: the first reader saw 2, the second 5"
    calls.take()
    for v in (1.0, 3.0):  # a decode loop: write, launch, download, again
        rt.write(x, np.full(4, v, np.float32))
        rt.launch(P.accumulate, acc, x)
        rt.download(acc)
    counts = calls.take()
    assert "event" not in counts, "contract: writes and downloads create no event"
    assert counts.get("compute.record", 0) == 0, "contract: each write followed a drain"
    assert rt.download(acc).tolist() == [11.0] * 4


def test_a_download_reads_the_latch_with_the_data_in_one_round(device_name, make_runtime, monkeypatch):
    """Guarantee (Runtime.download): complete data, then the error latch read (DeviceAssert when it
    is set). Contract of the host path: when work since the last latch read may have set it, the
    latch and the data come back in one device round (``memcpy_dtoh_many``: one wait for the copy
    stream); when nothing could have, the data alone. A set latch raises and stays set."""
    rt = make_runtime()
    x = rt.upload(np.arange(4, dtype=np.float32))
    rt.download(x)
    calls = _Calls(monkeypatch, rt)
    rt.launch(P.fill, x, value=3.0)
    rt.reset_error_latch()  # a launch that writes the latch: it may be set now
    assert rt.download(x).tolist() == [3.0] * 4
    assert calls.take() == {"dtoh_many": 1}, "contract: latch and data in one round"
    assert rt.download(x).tolist() == [3.0] * 4
    assert calls.take().get("dtoh") == 1, "contract: a quiet latch is not read again: the data alone"
    rt.launch(P.fill, rt.error_latch, value=1)  # a kernel that flags (site 1)
    with pytest.raises(DeviceAssert, match="latch set"):
        rt.download(x)
    with pytest.raises(DeviceAssert, match="latch set"):
        rt.download(x)  # sticky until reset
    rt.reset_error_latch()
    assert rt.download(x).tolist() == [3.0] * 4


@pytest.mark.parametrize("shapes", [[(2,), (3, 1)], [(0,), (4,)], [(5,)]])
def test_memcpy_dtoh_many_returns_each_copy_in_order(device_name, device, shapes):
    """Guarantee (Device.memcpy_dtoh_many): each copy complete and the host's own (a later write to
    the device memory does not change it), in the order given, zero-size arrays included."""
    stream = device.stream()
    refs, want = [], []
    from lockstep.reference_runtime.backends._base import ArrayRef

    for k, shape in enumerate(shapes):
        host = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 10 * k
        ref = ArrayRef(device.malloc(host.nbytes), shape, np.dtype(np.float32))
        device.memcpy_htod_async(ref, host, stream)
        refs.append(ref)
        want.append(host)
    got = device.memcpy_dtoh_many(refs, stream)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert all(g.shape == w.shape and g.dtype == w.dtype for g, w in zip(got, want))
    if want[-1].size:
        device.memcpy_htod_async(refs[-1], np.full(shapes[-1], -1.0, np.float32), stream)
        device.memcpy_dtoh(refs[-1], stream)
        assert got[-1].tolist() == want[-1].tolist(), "the returned array is the host's own"
    for ref in refs:
        device.free(ref.buffer)


def _add_model():
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 3]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_feed_checks_passed_before_still_refuse_a_bad_feed(device_name, make_runtime):
    """Guarantee (Executor feed checks): a feed of the wrong dtype or dims, a freed device tensor
    and one of another runtime are FeedErrors naming the input, also after feeds of the same names
    passed (the checks are cached by dtype and shape; the tensor checks run every time)."""
    rt = make_runtime()
    ex = Executor(_add_model(), rt)
    a = rt.upload(np.ones((2, 3), np.float32))
    b = np.full((2, 3), 2.0, np.float32)
    for _ in range(2):
        assert ex.run({"a": a, "b": b})["y"].tolist() == [[3.0] * 3] * 2
    with pytest.raises(FeedError, match="input 'b': dtype float64 given"):
        ex.run({"a": a, "b": b.astype(np.float64)})
    with pytest.raises(FeedError, match=r"input 'b': dim 0 \('n'\) is 3, but 'a' bound it to 2"):
        ex.run({"a": a, "b": np.zeros((3, 3), np.float32)})
    other = Runtime(SimDevice(), RuntimeConfig())
    with pytest.raises(FeedError, match="input 'a': device tensor .* another runtime"):
        ex.run({"a": other.upload(np.ones((2, 3), np.float32)), "b": b})
    rt.free(a)
    with pytest.raises(FeedError, match="input 'a': device tensor .* freed"):
        ex.run({"a": a, "b": b})
    fresh = rt.upload(np.full((2, 3), 4.0, np.float32))  # may reuse a's memory: its own entry
    assert ex.run({"a": fresh, "b": b})["y"].tolist() == [[6.0] * 3] * 2
    other.close()


def test_an_unsafe_in_place_bind_is_refused_after_safe_ones():
    """Guarantee (Executor.run, bind): binding an output over a feed a later node reads is refused,
    whatever was bound before (the rule per output is the graph's, memoised)."""
    g = helper.make_graph(
        [helper.make_node("Add", ["a", "one"], ["y"]), helper.make_node("Mul", ["a", "two"], ["z"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]), helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(np.float32(1), "one"), numpy_helper.from_array(np.float32(2), "two")])
    rt = Runtime(SimDevice(), RuntimeConfig())
    ex = Executor(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), rt)
    a, y = rt.upload(np.ones(2, np.float32)), rt.empty(2)
    for _ in range(2):
        ex.run({"a": a}, bind={"y": y})  # y bound elsewhere: safe
        ex.run({"a": a}, bind={"z": a})  # z's producer is a's last reader: safe in place
    with pytest.raises(FeedError, match="unsafe: a later node reads 'a'"):
        ex.run({"a": a}, bind={"y": a})
    with pytest.raises(FeedError, match=r"keep/bind name \['a'\], which are not graph outputs"):
        ex.run({"a": a}, bind={"a": y})


def test_a_session_step_with_other_tensors_of_the_same_shapes_is_another_signature():
    """Contract (CaptureSession signature: bound tensors and in-place feeds by identity): a step
    whose bound tensors are others, of the same shapes, is planned and captured anew, and writes
    its own tensors; the cached key of the previous tensors is not reused for them."""
    from lockstep.reference_runtime.engine import RefDecoder

    rt = Runtime(SimDevice(), RuntimeConfig())
    dec = RefDecoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx")), rt, capture=True)
    dec.forward([65])
    dec.forward([66])
    dec.forward([67])  # captured
    captures = dec.session.counters.captures
    eager = dec.session.counters.eager_steps
    old = dict(dec.cache)
    dec.cache = {p: rt.upload(rt.download(t), name=p) for p, t in old.items()}  # same bytes, new tensors
    dec._bind = {dec.present_of[p]: t for p, t in dec.cache.items()}
    before = {p: rt.download(t) for p, t in old.items()}
    new_before = {p: rt.download(t) for p, t in dec.cache.items()}
    dec.forward([68])
    assert dec.session.counters.eager_steps == eager + 1, "contract: a new signature warms up eagerly first"
    dec.forward([69])
    assert dec.session.counters.captures > captures, "contract: and is captured on its own"
    assert all(np.array_equal(rt.download(t), before[p]) for p, t in old.items()), \
        "contract: the previous signature's tensors are not written"
    assert all(not np.array_equal(rt.download(t), new_before[p]) for p, t in dec.cache.items()), \
        "contract: the new tensors get the steps' keys and values"
