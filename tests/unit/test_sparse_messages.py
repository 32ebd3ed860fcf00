"""The ldsparse ops' bad-input messages that name numbers and shapes, pinned word for word.

Why: on the GPU image (extension built by a host g++ that differs from torch's toolchain) every
check whose message formatted an integer or a shape through std::ostream segfaulted instead of
raising.  cpp/csrc/check_format.h now formats them with std::to_string; these tests pin the full
text (it must not change) on every device, and scan the sources so no check goes back to handing
c10::str a raw number or shape.
"""
import re
from pathlib import Path

import pytest
import torch

from lightning_dynmo import sparse

pytestmark = pytest.mark.skipif(not sparse.extension_available(), reason="needs the compiled extension")

_ON_CUDA = pytest.param("cuda", marks=(pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or not sparse.cuda_kernels_available(), reason="no CUDA kernels")))
CSRC = Path(__file__).resolve().parents[2] / "cpp" / "csrc"


def _inputs(device):
    """Valid spmm/sddmm inputs: 4 rows (one empty) x 3 columns, 6 non-zeros, 5 tokens."""
    crow = torch.tensor([0, 2, 2, 3, 6], dtype=torch.int32)
    col = torch.tensor([0, 2, 1, 0, 1, 2], dtype=torch.int32)
    t = dict(crow=crow, col=col, values=torch.randn(6), x=torch.randn(5, 3), bias=torch.randn(4),
             g=torch.randn(5, 4))
    return {k: v.to(device) for k, v in t.items()}


def _message(fn):
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value).split("\n")[0]  # TORCH_SHOW_CPP_STACKTRACES=1 appends a trace


_LIMIT = "exceeds the kernels' int32 limit (2147483647); split the input into smaller pieces"
_SPMM = [  # (how the valid call is broken, the whole message)
    (lambda t: t.update(values=t["values"].view(2, 3)),
     "ldsparse.spmm: values must be 1-D with one entry per non-zero (6 col_indices), got shape [2, 3]"),
    (lambda t: t.update(x=t["x"][0]), "ldsparse.spmm: x must be 2-D [tokens, in_features], got shape [3]"),
    (lambda t: t.update(bias=t["bias"].view(2, 2)),
     "ldsparse.spmm: bias must be 1-D with one entry per output row (4), got shape [2, 2]"),
    (lambda t: t.update(crow=t["crow"][:0]),
     "ldsparse.spmm: crow_indices must be 1-D with rows + 1 entries, got shape [0]"),
    (lambda t: t.update(crow=t["crow"][:1].expand(2**31 + 2), bias=None),  # stride 0: no memory
     f"ldsparse.spmm: rows = 2147483649 {_LIMIT}"),
]
_SDDMM = [
    (lambda t: t.update(g=t["g"][:-1]), "ldsparse.sddmm: g has 4 tokens but x has 5"),
    (lambda t: t.update(g=t["g"][:, :-1]), "ldsparse.sddmm: g has 3 columns but the pattern has 4 rows"),
    (lambda t: t.update(g=t["g"][0]), "ldsparse.sddmm: g [tokens, rows] and x [tokens, in_features] "
     "must be 2-D, got shapes [4] and [5, 3]"),
    (lambda t: t.update(g=t["g"].sum(), x=t["x"].new_zeros(2, 0, 3)), "ldsparse.sddmm: g [tokens, rows] "
     "and x [tokens, in_features] must be 2-D, got shapes [] and [2, 0, 3]"),
    (lambda t: t.update(col=t["col"].view(2, 3)), "ldsparse.sddmm: col_indices must be 1-D, got shape [2, 3]"),
]


@pytest.mark.parametrize("device", ["cpu", _ON_CUDA])
@pytest.mark.parametrize("case", range(len(_SPMM)))
def test_spmm_messages_name_the_numbers(device, case):
    t = _inputs(device)
    torch.ops.ldsparse.spmm(t["crow"], t["col"], t["values"], t["x"], t["bias"])  # valid as given
    breaks, expected = _SPMM[case]
    breaks(t)
    call = torch.ops.ldsparse.spmm
    assert _message(lambda: call(t["crow"], t["col"], t["values"], t["x"], t["bias"])) == expected


@pytest.mark.parametrize("device", ["cpu", _ON_CUDA])
@pytest.mark.parametrize("case", range(len(_SDDMM)))
def test_sddmm_messages_name_the_numbers(device, case):
    t = _inputs(device)
    torch.ops.ldsparse.sddmm(t["crow"], t["col"], t["g"], t["x"])
    breaks, expected = _SDDMM[case]
    breaks(t)
    assert _message(lambda: torch.ops.ldsparse.sddmm(t["crow"], t["col"], t["g"], t["x"])) == expected


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not sparse.cuda_kernels_available(),
                    reason="no CUDA kernels")
def test_cuda_token_limit_message():
    t = _inputs("cuda")
    x = t["x"][:1].expand(2**31, 3)  # stride 0: 2^31 tokens without the memory
    assert _message(lambda: torch.ops.ldsparse.spmm(t["crow"], t["col"], t["values"], x, None)) == \
        f"ldsparse.spmm: tokens = 2147483648 {_LIMIT}"


def test_csr_transpose_messages_name_the_numbers():
    t = _inputs("cpu")
    tr = torch.ops.ldsparse.csr_transpose
    assert _message(lambda: tr(t["crow"], t["col"], 2)) == \
        "ldsparse.csr_transpose: col_indices[1] = 2 is outside [0, n_cols = 2)"
    assert _message(lambda: tr(t["crow"], t["col"], -1)) == \
        "ldsparse.csr_transpose: n_cols must be >= 0, got -1"
    assert _message(lambda: tr(t["crow"], t["col"], 2**31)) == \
        f"ldsparse.csr_transpose: n_cols = 2147483648 {_LIMIT}"
    crow = t["crow"].clone()
    crow[-1] += 1
    assert _message(lambda: torch.ops.ldsparse.spmm(crow, t["col"], t["values"], t["x"], None)) == \
        "ldsparse.spmm: crow_indices must start at 0 and end at the number of non-zeros (6), got 0 and 7"


def test_attention_messages_name_the_numbers():
    """Full causal layout of 3 blocks of 16 over 40 tokens, one head; then one thing broken."""
    q = torch.randn(1, 1, 40, 8)
    rp = torch.tensor([[[0, 1, 3, 6]]], dtype=torch.int32)
    ci = torch.tensor([0, 0, 1, 0, 1, 2], dtype=torch.int32)
    slots = torch.arange(40, dtype=torch.int32).reshape(1, 1, 40)
    fwd = torch.ops.ldsparse.block_attn_fwd
    out, lse = fwd(q, q, q, rp, ci, 16, 1.0, slots)  # valid as given
    op = "ldsparse.block_attn_fwd: "
    q2 = torch.randn(1, 2, 40, 8)
    cases = [
        (lambda: fwd(q[0], q[0], q[0], rp, ci, 16, 1.0),
         "q, k, v must be [batch, heads, seq, head_dim], got q of shape [1, 40, 8]"),
        (lambda: fwd(q, q[:, :, :20], q, rp, ci, 16, 1.0),
         "q, k, v must have the same shape, got [1, 1, 40, 8], [1, 1, 20, 8], [1, 1, 40, 8]"),
        (lambda: fwd(q, q, q, rp, ci, 20, 1.0), "block_size must be 16, 32, 64 or 128, got 20"),
        (lambda: fwd(q, q, q, rp, ci, 16, 1.0, slots[0]),
         "slot_token must be [B, H, slots] = [1, 1, S], got [1, 40]"),
        (lambda: fwd(q, q, q, rp, ci, 16, 1.0, slots + 1),
         "slot_token values must be -1 or a token in [0, 40), got 40"),
        (lambda: fwd(q, q, q, rp, ci, 16, 1.0, slots.clamp(max=38)), "token 38 has two slots in head 0"),
        (lambda: fwd(q, q, q, rp, ci, 16, 1.0, torch.where(slots == 5, -1, slots)),
         "every token needs a slot; head 0 maps 39 of 40"),
        (lambda: fwd(q, q, q, rp[..., :-1].contiguous(), ci, 16, 1.0),
         "row_ptr must have shape [B, H, ceil(S / block_size) + 1] = [1, 1, 4] (S = 40 slots), got [1, 1, 3]"),
        (lambda: fwd(q, q, q, rp, ci.view(2, 3), 16, 1.0), "col_idx must be 1-D, got shape [2, 3]"),
        (lambda: fwd(q2, q2, q2, torch.tensor([[[0, 1, 3, 6], [5, 6, 8, 11]]], dtype=torch.int32),
                     torch.cat([ci, ci]), 16, 1.0),
         "row_ptr[b, h, 0] must equal the previous head's last offset (6; heads are stored one after "
         "another), got 5 at head 1"),
        (lambda: fwd(q, q, q, torch.tensor([[[0, 1, 0, 6]]], dtype=torch.int32), ci, 16, 1.0),
         "row_ptr must be non-decreasing and at most col_idx.numel() = 6"),
        (lambda: fwd(q, q, q, torch.tensor([[[0, 2, 3, 4]]], dtype=torch.int32),
                     torch.tensor([0, 1, 1, 2], dtype=torch.int32), 16, 1.0),
         "layout is not causal or out of range: block (0, 1) of head 0 (query block, key block) needs "
         "key <= query < 3"),
        (lambda: fwd(q, q, q, rp, torch.cat([ci, ci[:1]]), 16, 1.0),
         "the last offset of row_ptr (6) must equal col_idx.numel() (7)"),
    ]
    for call, expected in cases:
        assert _message(call) == op + expected
    cp = torch.tensor([[[0, 3, 5, 6]]], dtype=torch.int32)  # the transposed layout
    ri = torch.tensor([0, 1, 2, 1, 2, 2], dtype=torch.int32)
    bwd = torch.ops.ldsparse.block_attn_bwd
    bwd(q, q, q, q, out, lse, cp, ri, 16, 1.0)  # valid as given
    assert _message(lambda: bwd(q, q, q, q, out, lse[..., :-1], cp, ri, 16, 1.0)) == \
        "ldsparse.block_attn_bwd: lse must be [B, H, S] (S = 40 slots), got [1, 1, 39]"


# ------------------------------------------------------------------ no raw numbers in the sources
def _split_args(body):
    """Top-level comma-separated arguments of a macro call body (string literals kept whole)."""
    args, cur, depth, i = [], "", 0, 0
    while i < len(body):
        c = body[i]
        if c == '"':
            end = re.compile(r'"(?:[^"\\]|\\.)*"').match(body, i).end()
            cur, i = cur + body[i:end], end
            continue
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    return args + [cur.strip()]


def _torch_checks(text):
    """The argument lists of every TORCH_CHECK(...) in `text`."""
    for m in re.finditer(r"\bTORCH_CHECK\(", text):
        i, depth = m.end(), 1
        while depth:
            if text[i] == '"':
                i = re.compile(r'"(?:[^"\\]|\\.)*"').match(text, i).end()
                continue
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        yield _split_args(text[m.end():i - 1])


# Message parts c10::str may format: string literals, const char* names, dtypes and devices
# (printed as strings), CUDA error strings, and check_format.h's num()/shape().
_SAFE = re.compile(r'(("(?:[^"\\]|\\.)*"\s*)+|op|pn|in|what|name|ref_name|num\(.*\)|shape\(.*\)'
                   r'|.*scalar_type\(\)|.*device\(\)|cudaGetErrorString\(.*\))')


def _code(path):
    """A source file without its // comments (no string literal in cpp/csrc holds //)."""
    return re.sub(r"//[^\n]*", "", path.read_text())


def test_no_check_formats_a_raw_number_or_shape():
    patterns = ("*.h", "*.cpp", "cuda/*.cu", "cuda/*.cuh", "cuda/*.h", "cuda/*.cpp")
    files = sorted(p for pattern in patterns for p in CSRC.glob(pattern))
    sites, raw = 0, []
    for f in files:
        for args in _torch_checks(_code(f)):
            sites += 1
            raw += [f"{f.name}: {a}" for a in args[1:] if not _SAFE.fullmatch(a)]
            assert "<<" not in "".join(args[1:]), f"{f.name}: ostream insertion in a check"
    assert sites >= 60, f"found only {sites} TORCH_CHECK sites: the scan is broken"
    assert not raw, f"pass numbers through num() and shapes through shape() (check_format.h): {raw}"
    streams = re.compile(r"c10::str\(|std::\w*stream\b|std::cout|std::cerr|<iostream>|<sstream>")
    assert not [f.name for f in files if streams.search(_code(f))], "ostream use outside TORCH_CHECK"
