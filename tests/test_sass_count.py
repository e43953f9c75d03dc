"""benchmarks/sass_count.py's reading of SASS: opcodes with their modifiers, the tile loop as the longest stretch a
branch jumps back over, and programs an SM from registers and shared memory (the compile itself runs in
test_benchmarks_smoke.py)."""

from __future__ import annotations

from benchmarks import sass_count

# nvdisasm -c lines (address comment, instruction, encoding comment), two loops: a short one, then a longer one
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                                  /* 0x000 */
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;                                 /* 0x000 */
        /*0020*/              @!P0 BRA `(.L_x_0) ;                                         /* 0x000 */
.L_x_1:
        /*0030*/                   LDS.U8 R3, [R4] ;                                       /* 0x000 */
        /*0040*/                   LDS.U8 R5, [R4+0x1] ;                                   /* 0x000 */
        /*0050*/                   F2FP.F16.E4M3.UNPACK_B R6, R3 ;                         /* 0x000 */
        /*0060*/                   HMMA.16816.F32 R8, R10, R12, R8 ;                       /* 0x000 */
        /*0070*/               @P1 BRA `(.L_x_1) ;                                         /* 0x000 */
        /*0080*/                   EXIT ;                                                  /* 0x000 */
"""


def test_the_longest_backward_branch_is_the_tile_loop_and_opcodes_keep_their_modifiers() -> None:
    lines = sass_count.parse_sass(SASS)
    assert lines[0] == "MOV R1, c[0x0][0x28]" and ".L_x_1:" in lines
    loop = sass_count.longest_loop(lines)
    assert loop[0] == ".L_x_1:" and loop[-1] == "@P1 BRA `(.L_x_1)"
    counts = sass_count.opcodes(loop)
    assert counts == {"LDS.U8": 2, "F2FP.F16.E4M3.UNPACK_B": 1, "HMMA.16816.F32": 1, "BRA": 1}
    assert sass_count.opcodes(lines)["IADD3"] == 1 and sum(sass_count.opcodes(lines).values()) == 9


def test_programs_an_sm_take_the_tighter_of_registers_and_shared_memory() -> None:
    # the shipped FP8 decode knobs: 168 registers x 128 threads, 72 KiB -> 3 (both limits), as ncu reported
    assert sass_count.programs_per_sm(168, 72 * 1024, 4) == 3
    assert sass_count.programs_per_sm(196, 72 * 1024, 4) == 2  # registers bind
    assert sass_count.programs_per_sm(126, 104 * 1024, 4) == 2  # shared memory binds
    assert sass_count.programs_per_sm(126, 54 * 1024, 4) == 4
