"""bench.stream_copy_calls, the streaming probe's timed calls (bench ops' stream_us and scripts/stream-variants.py):
each call copies its own pair with the variant asked for, the pair's byte count, on the current stream, and a refusal
raises with libdifuse's message. A fake library stands in for libdifuse (no GPU here)."""
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
from difuse import bench  # noqa: E402
from difuse._capi import OK  # noqa: E402


class FakeLib:
    def __init__(self, status=OK):
        self.status, self.seen = status, []

    def difuse_probe_stream_copy(self, dst, src, nbytes, variant, stream):
        self.seen.append((dst, src, nbytes, variant, stream))
        return self.status


def _calls(lib, pairs, variant):
    stream = mock.Mock(cuda_stream=77)
    with mock.patch("difuse._loader.core", return_value=lib), \
            mock.patch("difuse._loader.last_error", return_value="variant 99 outside [0, 71)"), \
            mock.patch.object(torch.cuda, "current_stream", return_value=stream):
        return bench.stream_copy_calls(pairs, variant)


def test_each_call_copies_its_own_pair():
    pairs = [(torch.zeros(48, dtype=torch.uint8), torch.zeros(48, dtype=torch.uint8)) for _ in range(3)]
    lib = FakeLib()
    calls = _calls(lib, pairs, 5)
    assert len(calls) == 3
    for c in reversed(calls):
        c()
    assert lib.seen == [(b.data_ptr(), a.data_ptr(), 48, 5, 77) for a, b in reversed(pairs)]


def test_a_refusal_raises_with_the_library_message():
    pairs = [(torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8))]
    calls = _calls(FakeLib(status=OK + 1), pairs, 99)
    with mock.patch("difuse._loader.last_error", return_value="variant 99 outside [0, 71)"):
        with pytest.raises(RuntimeError, match="variant 99 outside"):
            calls[0]()


def test_mismatches_see_a_fused_op_whose_output_the_eager_chain_overwrites():
    """gelu_tanh into its concat slice: both arms write one `out`; the fused result is copied before the eager chain
    runs, so a wrong fused output counts (it used to be compared with the eager chain's overwrite of itself)."""
    out = torch.zeros(4, 8)
    x = torch.randn(4, 8)

    def fused(x, out):
        out.fill_(123.0)
        return out

    def eager(x, out):
        out.copy_(x * 2)
        return out

    assert bench.op_mismatches(fused, eager, (x, out)) == 32
    assert bench.op_mismatches(lambda x, out: out.copy_(x * 2), eager, (x, out)) == 0
    # tuples of outputs, copied one by one
    assert bench.op_mismatches(lambda x, out: (x * 2, out.fill_(1.0)), lambda x, out: (x * 2, out.copy_(x)),
                               (x, out)) == 32


class FakePartitionLib:
    """libdifuse's SM-partition probe: hands out stream 0xbeef of `give` SMs and records the launch count it is told."""

    def __init__(self, give=94, status=OK, set_status=OK):
        self.give, self.status, self.set_status, self.set_to = give, status, set_status, []

    def difuse_probe_sm_partition_stream(self, device, sms, stream_out, sms_out):
        if self.status == OK:
            stream_out._obj.value = 0xBEEF
            sms_out._obj.value = max(sms, self.give)
        return self.status

    def difuse_probe_set_launch_sm_count(self, device, sms):
        self.set_to.append((device, sms))
        return self.set_status


def _partition(lib, sms):
    with mock.patch("difuse._loader.core", return_value=lib), \
            mock.patch("difuse._loader.last_error", return_value="sm_partition: 200 SMs asked for; device 0 has 132"), \
            mock.patch.object(torch.cuda, "current_device", return_value=0), \
            mock.patch.object(torch.cuda, "ExternalStream", side_effect=lambda h, device: ("stream", h, device)):
        return bench.sm_partition(sms)


def test_sm_partition_sizes_the_launchers_for_the_sms_the_driver_gave():
    """The driver may round the count up: the launchers are told what it gave, and the bench records that."""
    lib = FakePartitionLib(give=94)
    stream, got = _partition(lib, 93)
    assert stream == ("stream", 0xBEEF, 0)
    assert got == 94
    assert lib.set_to == [(0, 94)]


def test_sm_partition_refusals_raise_with_the_library_message():
    lib = FakePartitionLib(status=OK + 2)
    with pytest.raises(RuntimeError, match="200 SMs asked for; device 0 has 132"):
        _partition(lib, 200)
    assert lib.set_to == []  # nothing was made, so no launch count was set
    with pytest.raises(RuntimeError, match="difuse_probe_set_launch_sm_count"):
        _partition(FakePartitionLib(set_status=OK + 2), 93)


def test_partition_sms_from_the_flag_or_the_environment():
    args = mock.Mock(sms=None)
    assert bench.partition_sms(args, {}) == 0
    assert bench.partition_sms(args, {"DIFUSE_BENCH_SMS": " "}) == 0
    assert bench.partition_sms(args, {"DIFUSE_BENCH_SMS": "80"}) == 80
    assert bench.partition_sms(mock.Mock(sms=94), {"DIFUSE_BENCH_SMS": "80"}) == 94  # the flag wins
    for bad in ("0", "-3", "eighty"):
        with pytest.raises(ValueError, match="DIFUSE_BENCH_SMS"):
            bench.partition_sms(args, {"DIFUSE_BENCH_SMS": bad})
    assert bench.knob_prefix({"DIFUSE_BENCH_SMS": "80", "DIFUSE_QK_WAN_OCCUPANCY": "0"}) == \
        "DIFUSE_QK_WAN_OCCUPANCY=0 DIFUSE_BENCH_SMS=80 "
