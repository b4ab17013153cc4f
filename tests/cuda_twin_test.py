"""The CUDA transport's steps without a GPU: the numpy twins (tests/transport_twin.py) against the
references the kernels mirror (lab/native/cuda/reference.cc) and against the §2.1
model, bit for bit (docs/design.md §2.1, §5).

The references run on any machine with a CUDA build (`cuda_build`); the kernels themselves are
held against the same references on a GPU (tests/cuda_transport_test.py) and on the CPU under the
host executor (tests/host_executor_transport_test.py). The §2.1 model is `Round.expected`
(tests/transport_helpers.py): the slot map, permute, unpermute and reduce composed over R ranks
must give its rows, weights and combined tokens exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from transport_helpers import DTYPES, Round
from transport_helpers import EXCHANGE_ROUTINGS as ROUTINGS
from transport_helpers import bits as _bits
from transport_helpers import gathered as gather_routing
from transport_helpers import layout_args as _layout_args
from transport_helpers import numpy_layout as _numpy_layout
from transport_helpers import routing as _routing
from transport_helpers import values as _values
from transport_twin import (
    numpy_permute,
    numpy_reduce,
    numpy_slot_map,
    numpy_unpermute,
)

from jax_hybridep import fp8
from lab import native_module

native = native_module.testing_module()

pytestmark = pytest.mark.usefixtures("cuda_build")


def _assert_slot_map(got: dict, want: dict, what: str):
    for key, value in want.items():
        np.testing.assert_array_equal(
            _bits(np.asarray(got[key])), _bits(value), err_msg=f"{what}: {key}"
        )


@pytest.mark.parametrize(
    "routing,ranks", [(r, n) for r in ROUTINGS for n in (1, 3, 4) if n > 1 or r != "empty_rank"]
)
def test_slot_map_twin_matches_the_reference(routing, ranks):
    """T = 70 tokens: two send chunks, the second partial."""
    case = Round(routing, "float32", 4, R=ranks, T=70, K=3, seed=ranks)
    gathered = gather_routing(case)
    for rank in range(ranks):
        want = numpy_slot_map(gathered, rank, case.C)
        got = native.cuda_slot_map(gathered, rank, case.C, reference=True)
        _assert_slot_map(got, want, f"rank {rank}")


def _with_capacity(case: Round, seed: int) -> Round:
    """The round's routing laid out with a capacity (f = 1.0, pad_multiple 4: rows dropped, padded
    groups, docs/design.md §2.1.3), its C-sized inputs drawn again for the new C."""
    rng = np.random.default_rng([seed, 17])
    E = 2 * case.R
    idx = _routing("random", rng, R=case.R, T=case.T, K=case.K, E=E)
    args = _layout_args(idx, E, "capacity")
    case.row_pos = _numpy_layout(**args)["row_pos"].astype(np.int32)
    safe = np.clip(idx, 0, E - 1)
    case.dest = np.where(case.row_pos >= 0, args["placement_rank"][safe], -1).astype(np.int32)
    case.C = args["rows"]
    case.y = _values(rng, (case.R, case.C, case.hidden), case.dtype)
    case.y_weights = rng.standard_normal((case.R, case.C)).astype(np.float32)
    case.scale = rng.standard_normal((case.R, case.C)).astype(np.float32)
    case.scale[:, ::5] *= -1
    return case


def _receive_buffers(case: Round, payload: np.ndarray, maps: list[dict]) -> list[np.ndarray]:
    """Each rank's dense receive buffer after every source's send: payload [R, T, ...] rows at
    the slots send_slot names."""
    buffers = [
        np.zeros((maps[0]["recv_rows"].shape[0],) + payload.shape[2:], payload.dtype)
        for _ in range(case.R)
    ]
    for src in range(case.R):
        slots = maps[src]["send_slot"][: case.T]
        for t, p in zip(*np.nonzero(slots >= 0), strict=True):
            buffers[p][slots[t, p]] = payload[src, t]
    return buffers


def _pipeline(case: Round, weighted: bool, fp8_hidden: int = 0) -> dict:
    """The transport over R ranks in numpy: slot map, send into dense slots, permute; unpermute,
    send the partials back, reduce; redispatch scaled. The §2.1 model's keys."""
    R, T = case.R, case.T
    gathered = gather_routing(case)
    maps = [numpy_slot_map(gathered, r, case.C) for r in range(R)]
    x = case.x
    if fp8_hidden:
        flat = case.x.reshape(R * T, -1)  # the send kernel quantises each token
        x = np.asarray(fp8.to_wire(*fp8.quantize(flat))).reshape(R, T, -1)
    received = _receive_buffers(case, x, maps)
    out = dict(recv_row_pos=None, tokens=[], weights=[], redispatched=[], scaled=[])
    partials = np.zeros((R, R, T, case.hidden), case.np_dtype)  # [source, destination, item]
    g_received = _receive_buffers(case, case.g, maps)
    for d in range(R):
        lay = maps[d]
        rows, _ = numpy_permute(
            received[d], lay, case.C, fp8_hidden=fp8_hidden, dtype=case.np_dtype
        )
        out["tokens"].append(rows)
        out["weights"].append(lay["row_weights"])
        red, scaled = numpy_permute(g_received[d], lay, case.C, scale=case.scale[d])
        out["redispatched"].append(red)
        out["scaled"].append(scaled)
        y_weights = case.y_weights[d] if weighted else None
        part = numpy_unpermute(case.y[d], y_weights, lay)
        n = int(lay["info"][0])
        for j, item in enumerate(lay["recv_item"][:n]):
            partials[item // T, d, item % T] = part[j]
    out["combined"] = [numpy_reduce(partials[src], case.dest[src]) for src in range(R)]
    del out["recv_row_pos"]
    return {key: np.stack(value) for key, value in out.items()}


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("routing", ROUTINGS + ("capacity",))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pipeline_gives_the_model(routing, dtype, ranks):
    """The steps composed over R ranks: exactly the §2.1 model's rows, weights, combined tokens
    and scaled redispatch (the bits v1 gives), dropless and with a capacity."""
    case = Round(
        "random" if routing == "capacity" else routing, dtype, 6, R=ranks, T=24, K=3, seed=1
    )
    if routing == "capacity":
        case = _with_capacity(case, ranks)
        assert np.any(case.row_pos < 0) and case.C % 4 == 0  # drops, padded groups
    for weighted in (False, True):
        got = _pipeline(case, weighted)
        want = case.expected(weighted)
        for key, value in got.items():
            bits = _bits(value)
            np.testing.assert_array_equal(
                bits, _bits(want[key]).reshape(bits.shape), err_msg=f"weighted={weighted}: {key}"
            )


@pytest.mark.parametrize("routing", ["random", "duplicates"])
def test_pipeline_fp8_gives_the_model(routing):
    """FP8 on the wire (docs/design.md §2.1.8): the rows are the model's tokens quantised and
    dequantised once, as every backend computes them."""
    case = Round(routing, "bfloat16", 200, R=3, T=24, K=3, seed=2)
    got = _pipeline(case, weighted=True, fp8_hidden=200)
    flat = case.x.reshape(-1, 200)
    case.x = np.asarray(fp8.dequantize(*fp8.quantize(flat), case.np_dtype)).reshape(case.x.shape)
    want = case.expected(weighted=True)
    np.testing.assert_array_equal(_bits(got["tokens"]), _bits(want["tokens"]))


def _reference_slots(buffer: np.ndarray, stride: int) -> np.ndarray:
    """A receive buffer as the window holds it: slots of `stride` bytes."""
    raw = buffer.reshape(buffer.shape[0], -1).view(np.uint8)
    slots = np.zeros((raw.shape[0], stride), np.uint8)
    slots[:, : raw.shape[1]] = raw
    return slots


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_row_step_twins_match_the_references(routing, dtype):
    """Permute (plain, scaled, both zero lines), unpermute (weighted or not) and reduce."""
    case = Round(routing, dtype, 7, R=3, T=24, K=3, seed=3)
    gathered = gather_routing(case)
    rng = np.random.default_rng(11)
    for d in range(case.R):
        lay = numpy_slot_map(gathered, d, case.C)
        n = int(lay["info"][0])
        buffer = _values(rng, (lay["recv_rows"].shape[0], case.hidden), dtype)
        row_bytes = case.hidden * np.dtype(DTYPES[dtype]).itemsize
        slots = _reference_slots(buffer, -(-row_bytes // 16) * 16)
        for pad in (0, 4):
            for scale in (None, case.scale[d]):
                got, got_scaled = native.cuda_reference_permute(
                    dtype,
                    slots,
                    row_bytes,
                    lay["recv_rows"],
                    lay["row_slot"],
                    lay["info"],
                    zero_pad_multiple=pad,
                    scale=scale,
                )
                want, want_scaled = numpy_permute(buffer, lay, case.C, pad, scale)
                np.testing.assert_array_equal(got, _bits(want).reshape(got.shape))
                if scale is not None:
                    np.testing.assert_array_equal(got_scaled, _bits(want_scaled).reshape(got.shape))
        for weights in (None, case.y_weights[d]):
            y = case.y[d]
            got = native.cuda_reference_unpermute(
                dtype,
                y.view(np.uint8).reshape(case.C, -1),
                weights,
                lay["recv_rows"],
                lay["row_slot"],
                lay["info"],
            )
            want = numpy_unpermute(y, weights, lay)
            assert got.shape[0] == n
            np.testing.assert_array_equal(got, _bits(want).reshape(got.shape))
    partials = _values(rng, (case.R, case.T, case.hidden), dtype)
    for src in range(case.R):
        got = native.cuda_reference_reduce(
            dtype, partials.view(np.uint8).reshape(case.R, case.T, -1), case.dest[src]
        )
        np.testing.assert_array_equal(got, _bits(numpy_reduce(partials, case.dest[src])))


@pytest.mark.parametrize("hidden", [128, 200])
def test_fp8_permute_twin_matches_the_reference(hidden):
    """Wire rows dequantised into each row (every bf16 pattern among the tokens)."""
    case = Round("random", "bfloat16", hidden, R=2, T=24, K=3, seed=4)
    lay = numpy_slot_map(gather_routing(case), 1, case.C)
    patterns = np.arange(1 << 16, dtype=np.uint16).view(DTYPES["bfloat16"])
    tokens = np.resize(
        np.random.default_rng(5).permutation(patterns), (lay["recv_rows"].shape[0], hidden)
    )
    wire = np.asarray(fp8.to_wire(*fp8.quantize(tokens)))
    slots = _reference_slots(wire, -(-wire.shape[1] // 16) * 16)
    got, _ = native.cuda_reference_permute(
        "bfloat16",
        slots,
        wire.shape[1],
        lay["recv_rows"],
        lay["row_slot"],
        lay["info"],
        fp8_hidden=hidden,
    )
    want, _ = numpy_permute(wire, lay, case.C, fp8_hidden=hidden, dtype=DTYPES["bfloat16"])
    np.testing.assert_array_equal(got, _bits(want).reshape(got.shape))


def test_reference_hooks_reject_bad_maps():
    case = Round("random", "float32", 4, R=2)
    gathered = gather_routing(case)
    bad = gathered.copy()
    bad[0, 0, 0, 0] = 2
    with pytest.raises(ValueError, match="destination outside"):
        native.cuda_slot_map(bad, 0, case.C)
    with pytest.raises(ValueError, match="rank must be"):
        native.cuda_slot_map(gathered, 2, case.C)
    lay = numpy_slot_map(gathered, 0, case.C)
    rows = lay["recv_rows"].copy()
    rows[0, :2] = 0
    slots = np.zeros((rows.shape[0], 16), np.uint8)
    with pytest.raises(ValueError, match="filled twice"):
        native.cuda_reference_permute("float32", slots, 16, rows, lay["row_slot"], lay["info"])
