"""Gated DeltaNet (kvd.model.layers.gated_delta): the native kernel and the torch path against a float64
reference, the same bits for a sequence alone, batched and chunked, and bad steps refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvd.distributed.step import RecurrentRows
from kvd.kernels import cpu_native
from kvd.model.config import LinearAttention
from kvd.model.layers.gated_delta import _gated_delta_torch
from kvd.model.layers.recurrent_state import LayerState, RecurrentStep

SHAPE = LinearAttention(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8, conv_kernel=4)
NUM_SLOTS = 6

pytestmark = pytest.mark.skipif(
    not cpu_native.available(), reason="needs a C compiler for the native kernels"
)


def inputs(rows: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    heads = SHAPE.num_value_heads
    return {
        "qkv": torch.randn(rows, SHAPE.conv_dim, generator=g).to(dtype),
        "a": torch.randn(rows, heads, generator=g).to(dtype),
        "b": torch.randn(rows, heads, generator=g).to(dtype),
    }


def weights(seed: int = 99) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel, generator=g) * 0.5,
        "A_log": torch.rand(SHAPE.num_value_heads, generator=g).log(),
        "dt_bias": torch.randn(SHAPE.num_value_heads, generator=g),
    }


def empty_state(dtype: torch.dtype) -> LayerState:
    return LayerState(
        torch.zeros(NUM_SLOTS, SHAPE.conv_kernel - 1, SHAPE.conv_dim, dtype=dtype),
        torch.zeros(NUM_SLOTS, SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim),
    )


class Layer:
    """What _gated_delta_torch reads of a GatedDeltaNet: its shape and state."""

    def __init__(self, state: LayerState) -> None:
        self.shape, self.state = SHAPE, state


def fresh(lengths: list[int], slots: list[int]) -> RecurrentStep:
    """A step of sequences that start here, each in its slot."""
    return RecurrentStep.build(lengths, [RecurrentRows(s, -1) for s in slots])


def run(native: bool, x: dict, w: dict, state: LayerState, step: RecurrentStep) -> torch.Tensor:
    if native:
        return cpu_native.gated_delta(
            x["qkv"], x["a"], x["b"], w["weight"], w["A_log"], w["dt_bias"], state.conv, state.state,
            step.starts_t, step.kernel_args, SHAPE.num_key_heads,
        )  # fmt: skip
    return _gated_delta_torch(
        x["qkv"], x["a"], x["b"], w["weight"], w["A_log"], w["dt_bias"], Layer(state), step
    )


def reference(x: dict, w: dict) -> torch.Tensor:
    """One fresh sequence over all rows, in float64, as transformers' recurrent form computes it."""
    qkv, a, b = (x[k].double() for k in ("qkv", "a", "b"))
    rows, kernel = qkv.shape[0], SHAPE.conv_kernel
    padded = torch.cat((torch.zeros(kernel - 1, SHAPE.conv_dim, dtype=torch.float64), qkv))
    conv = sum(padded[j : j + rows] * w["weight"].double()[:, j] for j in range(kernel))
    q, k, v = F.silu(conv).split([SHAPE.key_dim, SHAPE.key_dim, SHAPE.value_dim], dim=-1)
    group = SHAPE.num_value_heads // SHAPE.num_key_heads
    q = F.normalize(q.reshape(rows, SHAPE.num_key_heads, -1), dim=-1, eps=0).repeat_interleave(group, 1)
    k = F.normalize(k.reshape(rows, SHAPE.num_key_heads, -1), dim=-1, eps=0).repeat_interleave(group, 1)
    q = q / SHAPE.key_head_dim**0.5
    v = v.reshape(rows, SHAPE.num_value_heads, -1)
    decay = torch.exp(-w["A_log"].double().exp() * F.softplus(a + w["dt_bias"].double()))
    beta = b.sigmoid()
    s = torch.zeros(SHAPE.num_value_heads, SHAPE.key_head_dim, SHAPE.value_head_dim, dtype=torch.float64)
    out = []
    for t in range(rows):
        s = s * decay[t, :, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t, :, None]
        s = s + k[t, :, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_matches_a_float64_reference(native):
    x, w = inputs(23, torch.float32, 1), weights()
    out = run(native, x, w, empty_state(torch.float32), fresh([23], [2]))
    ref = reference(x, w)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_sequence_gets_the_same_bits_alone_batched_and_chunked(native, dtype):
    """Three sequences in one step against each alone, and each in chunks of 1, 5 and the rest (the state and the
    convolution's window carried between steps), in slots other than its own alone. The torch path (a CPU
    without the native kernels) only to within rounding: torch's exp and sigmoid round the vectorized body of a
    tensor and its tail differently, so a row's bits depend on where it lies in the batch."""

    def same(ours: torch.Tensor, expected: torch.Tensor) -> bool:
        if native:
            return torch.equal(ours, expected)
        return torch.allclose(ours.float(), expected.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)

    lengths = [7, 19, 1]
    seqs = [inputs(n, dtype, 10 + i) for i, n in enumerate(lengths)]
    w = weights()
    alone = [
        run(native, x, w, empty_state(dtype), fresh([n], [0])) for x, n in zip(seqs, lengths, strict=True)
    ]
    state = empty_state(dtype)
    batch = {k: torch.cat([x[k] for x in seqs]) for k in ("qkv", "a", "b")}
    batched = run(native, batch, w, state, fresh(lengths, [4, 1, 3]))
    assert same(batched, torch.cat(alone))
    for i, (x, n) in enumerate(zip(seqs, lengths, strict=True)):
        state, done, parts = empty_state(dtype), 0, []
        for size in (1, 5, n):
            size = min(size, n - done)
            if size == 0:
                break
            part = {k: x[k][done : done + size].contiguous() for k in x}
            source = 5 if done else -1
            done += size
            parts.append(run(native, part, w, state, RecurrentStep.build([size], [RecurrentRows(5, source)])))
        assert same(torch.cat(parts), alone[i]), f"sequence {i} in chunks"


def test_native_and_torch_paths_agree_within_rounding():
    x, w = inputs(31, torch.float32, 3), weights()
    step = fresh([31], [1])
    native = run(True, x, w, empty_state(torch.float32), step)
    torch_path = run(False, x, w, empty_state(torch.float32), step)
    assert ((native - torch_path).abs().max() / torch_path.abs().max()).item() < 1e-5


def test_a_later_step_reads_the_state_it_left():
    """The state slot and the window carry the sequence on; a fresh sequence in the slot reads none of it."""
    x, w = inputs(12, torch.float32, 4), weights()
    whole = run(True, x, w, empty_state(torch.float32), fresh([12], [0]))
    state = empty_state(torch.float32)
    first = {k: v[:6].contiguous() for k, v in x.items()}
    second = {k: v[6:].contiguous() for k, v in x.items()}
    run(True, first, w, state, fresh([6], [3]))
    assert state.state[3].abs().sum() > 0 and state.conv[3].abs().sum() > 0
    assert torch.equal(
        run(True, second, w, state, RecurrentStep.build([6], [RecurrentRows(3, 3)])), whole[6:]
    )
    assert torch.equal(run(True, x, w, state, fresh([12], [3])), whole)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_a_snapshot_resumes_a_sequence_as_if_it_had_run_on(native):
    """A snapshot after row 4 of a 9-row chunk (the sequence's rows 3 .. 11), then another sequence resumes from
    it in its own slot: its rows 8 .. are the bits the first sequence computed there."""
    x, w = inputs(12, torch.float32, 7), weights()
    whole = run(native, x, w, empty_state(torch.float32), fresh([12], [0]))
    state = empty_state(torch.float32)
    head = {k: v[:3].contiguous() for k, v in x.items()}
    rest = {k: v[3:].contiguous() for k, v in x.items()}
    run(native, head, w, state, fresh([3], [1]))
    run(native, rest, w, state, RecurrentStep.build([9], [RecurrentRows(1, 1, ((4, 5),))]))
    tail = {k: v[8:].contiguous() for k, v in x.items()}
    resumed = run(native, tail, w, state, RecurrentStep.build([4], [RecurrentRows(2, 5)]))
    if native:
        assert torch.equal(resumed, whole[8:])
        assert torch.equal(state.state[2], state.state[1])
    else:
        assert torch.allclose(resumed, whole[8:], rtol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_snapshots_after_several_rows_hold_each_rows_state(native):
    """A draft's rows: snapshots after rows 0, 1 and 2 of a 4-row step (two at row 1) hold the window and state as
    they were after those rows, the bits of steps that stop there."""
    x, w = inputs(10, torch.float32, 8), weights()
    state = empty_state(torch.float32)
    head = {k: v[:6].contiguous() for k, v in x.items()}
    run(native, head, w, state, fresh([6], [0]))
    tail = {k: v[6:].contiguous() for k, v in x.items()}
    snapshots = ((0, 2), (1, 3), (1, 5), (2, 4))
    run(native, tail, w, state, RecurrentStep.build([4], [RecurrentRows(0, 0, snapshots)]))
    for rows, slot in ((1, 2), (2, 3), (2, 5), (3, 4)):
        alone = empty_state(torch.float32)
        run(native, head, w, alone, fresh([6], [0]))
        run(
            native,
            {k: v[:rows] for k, v in tail.items()},
            w,
            alone,
            RecurrentStep.build([rows], [RecurrentRows(0, 0)]),
        )
        assert torch.equal(state.state[slot], alone.state[0]) and torch.equal(state.conv[slot], alone.conv[0])


@pytest.mark.parametrize(
    "rows",
    [
        [RecurrentRows(0, -1), RecurrentRows(0, -1)],  # one slot written by two sequences
        [RecurrentRows(0, -1), RecurrentRows(NUM_SLOTS, -1)],  # out of range
        [RecurrentRows(-1, -1), RecurrentRows(2, -1)],
        [RecurrentRows(0, -1, ((0, 1),)), RecurrentRows(1, -1)],  # a snapshot into another's live slot
        [RecurrentRows(0, 1), RecurrentRows(1, 1)],  # a source another sequence writes
        [RecurrentRows(0, -1, ((2, 4),)), RecurrentRows(1, -1)],  # a snapshot after a row it does not have
        [RecurrentRows(0, -1, ((0, 4),)), RecurrentRows(1, -1, ((1, 4),))],  # two snapshots into one slot
        [RecurrentRows(0, -1, ((0, 4), (1, 4))), RecurrentRows(1, -1)],  # one sequence's, into one slot
        [RecurrentRows(0, -1, ((1, 4), (0, 5))), RecurrentRows(1, -1)],  # rows out of order
        [RecurrentRows(0, 4), RecurrentRows(1, -1, ((0, 4),))],  # a source another sequence snapshots into
    ],
)
def test_bad_steps_are_refused_before_any_write(rows):
    x, w = inputs(4, torch.float32, 5), weights()
    state = empty_state(torch.float32)
    state.state.fill_(7.0)
    before = state.state.clone()
    with pytest.raises(cpu_native.NativeKernelError, match="index out of range"):
        run(True, x, w, state, RecurrentStep.build([2, 2], rows))
    assert torch.equal(state.state, before)


def test_rows_that_do_not_match_the_step_are_refused():
    x, w = inputs(4, torch.float32, 6), weights()
    with pytest.raises(cpu_native.NativeKernelError, match="do not match"):
        run(True, x, w, empty_state(torch.float32), fresh([3], [0]))
