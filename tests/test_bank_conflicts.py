"""Meta-tests of the shared-memory bank-conflict model (``kernels.common.bank_conflicts``), which the compile tests
use on the generated CUDA of our kernels: the per-phase rule checked against closed forms, and the parser against
small hand-written sources in TileLang's style.  CPU only, no TileLang."""

from math import gcd

import pytest
from hypothesis import given, settings

from kernels.common.bank_conflicts import (Site, access_sites, buffer_degrees, main, shared_buffers, site_degree,
                                           warp_degree, worst_degrees)
from tests.strategies import strided_lane_access

TX = "((int)threadIdx.x)"


def test_warp_degree_known_patterns():
    assert warp_degree([4 * lane for lane in range(32)], 4) == 1             # consecutive words
    assert warp_degree([0] * 32, 4) == 1                                     # one word: a broadcast
    assert warp_degree([128 * lane for lane in range(32)], 4) == 32          # one bank, 32 words
    assert warp_degree([8 * lane for lane in range(32)], 4) == 2             # every other bank, twice round
    assert warp_degree([16 * lane for lane in range(32)], 16) == 1           # 16-byte: quarter-warp phases
    assert warp_degree([256 * lane for lane in range(32)], 16) == 8          # 8 lanes of a phase on banks 0..3
    assert warp_degree([8 * lane for lane in range(32)], 8) == 1             # 8-byte: half-warp phases
    assert warp_degree([2 * lane for lane in range(32)], 2) == 1             # bf16 pairs share words


@settings(max_examples=200, deadline=None)
@given(strided_lane_access())
def test_warp_degree_of_strided_lanes(acc):
    """Lanes ``stride = m * width`` bytes apart, 4-, 8- or 16-byte accesses: a phase has L = 128 / width lanes and
    the 32 banks hold L access-wide slots; lane l takes slot l * m mod L, so the degree is gcd(m, L) (m = 0: one
    address, a broadcast).  Accesses of 1 or 2 bytes at word-multiple strides behave like 4-byte ones; a uniform
    base offset never changes a degree."""
    base, stride, width = acc
    got = warp_degree([base + lane * stride for lane in range(32)], width)
    if width >= 4:
        m = stride // width
        assert got == (1 if m == 0 else gcd(m, 128 // width)), (base, stride, width, got)
    elif stride % 4 == 0:
        assert got == (1 if stride == 0 else gcd(stride // 4, 32)), (base, stride, width, got)
    assert 1 <= got <= 32


def _src(stmt: str) -> str:
    return ("extern \"C\" __global__ void __launch_bounds__(128, 1) k(bfloat16_t* __restrict__ g) {\n"
            "  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];\n"
            "  void* t_s = ((void*)((char*)buf_dyn_shmem + 0));\n"
            "  __shared__ __align__(16) float red_buf[128];\n"
            f"  {stmt}\n}}\n")


# the accumulator fragment's bf16x2 stores into a [rows, 32] bf16 tile: thread tx holds row (tx & 31) >> 2 of its
# warp's 8-row band, columns (tx & 3) * 2 + {0, 1}, 16 steps i_1 over column blocks of 8
_ROW_MAJOR = (f"(((((i_1 >> 2) * 2048) + (({TX} >> 5) * 512)) + (((({TX} & 31) >> 2) * 32)) + ((i_1 & 3) * 8)) "
              f"+ (({TX} & 3) * 2))")
_SWIZZLED = (f"(((((i_1 >> 2) * 2048) + (({TX} >> 5) * 512)) + (((({TX} & 31) >> 2) * 32)) + "
             f"((((i_1 & 3) ^ ((({TX} & 31) >> 3) & 3))) * 8)) + (({TX} & 3) * 2))")


def test_parser_finds_stores_loads_and_widths():
    src = _src(f"*(uint1*)(((bfloat16_t*)t_s) + {_ROW_MAJOR}) = *(uint1*)(x + 0);\n"
               f"  *(uint4*)(g + 0) = *(uint4*)(((bfloat16_t*)t_s) + ({TX} * 8));\n"
               f"  float y = ((float)((bfloat16_t*)t_s)[({TX} * 64)]);\n"
               "  tl::initialize_wgmma_descriptor<1, 1, 64>(d, (&(((bfloat16_t*)t_s)[0])));\n"
               f"  red_buf[{TX}] = 0.f;")
    sites = access_sites(src, "t_s")
    assert [(s.width, s.elem, s.store) for s in sites] == [(4, 2, True), (16, 2, False), (2, 2, False)]
    assert shared_buffers(src) == ["t_s", "red_buf"]
    d = dict((s.width, deg) for s, deg in buffer_degrees(src, "t_s"))
    assert d[4] == 4           # rows of 64 bytes: rows r and r + 2 share banks, 4 of the 8 rows on each
    assert d[16] == 1          # 16 consecutive bytes a lane
    assert d[2] == 32          # 128 bytes apart: every lane in bank 0
    assert worst_degrees(src)["red_buf"] == (0, 0)     # an array indexed directly is not parsed: no site, degree 0


def test_swizzle_removes_the_row_major_conflict():
    plain = _src(f"*(uint1*)(((bfloat16_t*)t_s) + {_ROW_MAJOR}) = v;")
    swz = _src(f"*(uint1*)(((bfloat16_t*)t_s) + {_SWIZZLED}) = v;")
    assert worst_degrees(plain, ["t_s"]) == {"t_s": (4, 1)}
    assert worst_degrees(swz, ["t_s"]) == {"t_s": (1, 1)}


def test_unevaluable_addresses_are_reported_not_guessed():
    s = Site(1, 4, 4, f"(({TX} < 16) ? {TX} : 0)", True)
    assert site_degree(s, 128) is None
    s = Site(1, 4, 4, f"foo({TX})", True)
    assert site_degree(s, 128) is None


def test_warps_with_negative_addresses_are_skipped():
    """Warp-specialised kernels subtract the producer warpgroup's thread count: only warps 4..7 of 256 threads
    address the tile; a store whose consumer warps are conflict-free reads 1, not the other warps' garbage."""
    s = Site(1, 4, 4, f"(({TX} - 128) * 1)", True)
    assert site_degree(s, 256) == 1
    s = Site(1, 4, 4, f"((({TX} - 128) & 31) * 32)", True)
    assert site_degree(s, 256) == 32


def test_cli_reports_a_source_file(tmp_path, capsys):
    f = tmp_path / "k.cu"
    f.write_text(_src(f"*(uint1*)(((bfloat16_t*)t_s) + {_ROW_MAJOR}) = v;"))
    assert main(["--source", str(f)]) == 0
    out = capsys.readouterr().out
    assert "(128 threads)" in out and "t_s" in out and "st 4-way" in out
    assert main(["no-such-kernel-name"]) == 2


def test_stmatrix_rows_are_16_byte_accesses():
    """``stmatrix`` / ``ldmatrix``: each lane's row address, a 16-byte access; rows 128 bytes apart put the 8 rows of
    a matrix in one group of 4 banks (8-way), rows 16 bytes apart none."""
    wide = _src(f"tl::ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)t_s)[({TX} * 64)])), a, b, c, d);")
    packed = _src(f"tl::ptx_ldmatrix_x4((&(((bfloat16_t*)t_s)[({TX} * 8)])), a);")
    (s, d), = buffer_degrees(wide, "t_s")
    assert (s.width, s.store, d) == (16, True, 8)
    (s, d), = buffer_degrees(packed, "t_s")
    assert (s.width, s.store, d) == (16, False, 1)


def test_addresses_are_integer_arithmetic_never_code():
    """An address read from a .cu file is evaluated as integer arithmetic on known names: a call, an attribute or a
    string is refused (the site is reported as not evaluated), so a crafted source cannot run code."""
    from kernels.common.bank_conflicts import integer_expression
    assert integer_expression("(tx >> 2) * 8 + (i_1 ^ (tx & 7)) % 64 - ~1")({"tx": 9, "i_1": 3}) == 16 + 2 + 2
    for bad in ("__import__('os').getcwd()", "tx.real", "'a' * 3", "[tx][0]", "tx if tx else 0", "2 ** 3"):
        with pytest.raises(SyntaxError):
            integer_expression(bad)
    site = Site(1, 4, 4, "__import__('os').getcwd()", False)
    assert site_degree(site, 32) is None
