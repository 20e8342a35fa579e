#!/usr/bin/env python3
"""Writes wgmma_ops.cuh: one inline-PTX wrapper per wgmma shape the GEMM and the attention kernels use.

wgmma takes its fp32 accumulators as N/2 separate register operands, which inline asm can only spell
out one by one; this script spells them out so the header stays free of hand-copied operand lists.
Three operand forms:
  * SS (A and B from shared memory, both as descriptors), with a run-time accumulate flag: the GEMM's
    mainloop, the attention forward's S = Q K^T, the backward's S^T = K Q^T, dP^T = V dO^T (n64: 64
    queries per step) and dQ = dS K (n64: one 64-column block of the head dim).
  * RS (A from registers, B from shared memory), always accumulating: the attention's O += P V (and the
    backward's dV += P^T dO, dK += dS^T Q), whose A is the previous product's accumulator fragment
    re-packed to bf16 (4 x bf16x2 per thread).
  * FP8 SS (m64nNk32, A and B FP8 from shared memory, both K-major: FP8 wgmma has no transpose), with the
    run-time accumulate flag: the GEMM's FP8 mainloop, for the format pairs the FP8 recipe multiplies
    (e4m3 x e4m3 forward; e5m2 gradients x e4m3 in the dgrad and wgrad run as forwards on transposed copies).
Run it from this folder after changing the shape lists: python3 gen_wgmma.py > wgmma_ops.cuh
"""

SS_SHAPES = [64, 128, 256]  # the n of m64nNk16, A and B from shared memory
RS_SHAPES = [64, 128]  # the n of m64nNk16, A from registers
FP8_SHAPES = [128, 256]  # the n of m64nNk32 on FP8 operands
FP8_PAIRS = [("e4m3", "e4m3"), ("e5m2", "e4m3")]  # (A, B) formats


def accumulator_lines(regs):
    """The output operand list "+f"(d[0]), ... of the asm statement, 8 per line."""
    operands = [f'"+f"(d[{i}])' for i in range(regs)]
    lines = []
    for row in range(0, regs, 8):
        chunk = ", ".join(operands[row:row + 8])
        prefix = "      : " if row == 0 else "        "
        sep = "" if row + 8 >= regs else ","
        lines.append(f"{prefix}{chunk}{sep}")
    return lines


def placeholder_lines(regs):
    """The accumulator placeholders %0 ... %(regs-1) inside the braces, 16 per line."""
    placeholders = [f"%{i}" for i in range(regs)]
    lines = []
    for row in range(0, regs, 16):
        chunk = ", ".join(placeholders[row:row + 16])
        sep = "," if row + 16 < regs else ""
        lines.append(f'      "{chunk}{sep}"')
    return lines


def ss_wrapper(n):
    regs = n // 2
    lines = []
    lines.append(f"// D[64 x {n}] (+)= A[64 x 16] B[16 x {n}], bf16 operands from shared memory, fp32 accumulators.")
    lines.append("template <int kTransA, int kTransB>")
    lines.append(f"__device__ __forceinline__ void wgmma_m64n{n}k16(float (&d)[{regs}], uint64_t desc_a, uint64_t desc_b,")
    lines.append("                                                 int accumulate) {")
    lines.append("  asm volatile(")
    lines.append('      "{\\n.reg .pred p;\\n"')
    lines.append(f'      "setp.ne.b32 p, %{regs + 2}, 0;\\n"')
    lines.append(f'      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{"')
    lines += placeholder_lines(regs)
    lines.append(f'      "}}, %{regs}, %{regs + 1}, p, 1, 1, %{regs + 3}, %{regs + 4};\\n}}\\n"')
    lines += accumulator_lines(regs)
    lines.append('      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kTransA), "n"(kTransB)')
    lines.append('      : "memory");')
    lines.append("}")
    return "\n".join(lines)


def rs_wrapper(n):
    regs = n // 2
    lines = []
    lines.append(f"// D[64 x {n}] += A[64 x 16] B[16 x {n}], A (bf16) from registers, B (bf16) from shared memory.")
    lines.append("template <int kTransB>")
    lines.append(f"__device__ __forceinline__ void wgmma_m64n{n}k16_rs(float (&d)[{regs}], const uint32_t (&a)[4], uint64_t desc_b) {{")
    lines.append("  asm volatile(")
    lines.append(f'      "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{"')
    lines += placeholder_lines(regs)
    a = ", ".join(f"%{regs + i}" for i in range(4))
    lines.append(f'      "}}, {{{a}}}, %{regs + 4}, 1, 1, 1, %{regs + 5};\\n"')
    lines += accumulator_lines(regs)
    lines.append('      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB)')
    lines.append('      : "memory");')
    lines.append("}")
    return "\n".join(lines)


def fp8_wrapper(n, a, b):
    regs = n // 2
    lines = []
    lines.append(f"// D[64 x {n}] (+)= A[64 x 32] B[32 x {n}], A {a} and B {b} from shared memory (both K-major), fp32")
    lines.append("// accumulators.")
    lines.append(f"__device__ __forceinline__ void wgmma_m64n{n}k32_{a}_{b}(float (&d)[{regs}], uint64_t desc_a, uint64_t desc_b,")
    lines.append("                                                        int accumulate) {")
    lines.append("  asm volatile(")
    lines.append('      "{\\n.reg .pred p;\\n"')
    lines.append(f'      "setp.ne.b32 p, %{regs + 2}, 0;\\n"')
    lines.append(f'      "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.{a}.{b} {{"')
    lines += placeholder_lines(regs)
    lines.append(f'      "}}, %{regs}, %{regs + 1}, p, 1, 1;\\n}}\\n"')
    lines += accumulator_lines(regs)
    lines.append('      : "l"(desc_a), "l"(desc_b), "r"(accumulate)')
    lines.append('      : "memory");')
    lines.append("}")
    return "\n".join(lines)


def main():
    print("// GENERATED by gen_wgmma.py (do not edit): inline-PTX wrappers of wgmma.mma_async.m64nNk16 for bf16")
    print("// operands and of m64nNk32 for FP8 operands, fp32 accumulators in registers. SS: A and B in shared memory")
    print("// (matrix descriptors); RS: A in registers (the m64 x k16 fragment as 4 x bf16x2 per thread), B in shared")
    print("// memory; FP8: SS with both operands K-major.")
    print("// kTransA / kTransB: 0 = K-major tile, 1 = MN-major tile (the transpose is free for 16-bit types).")
    print("// accumulate == 0 makes the SS instruction overwrite d (scale-d = false), so a tile needs no zeroing;")
    print("// the RS form always accumulates (scale-d = 1).")
    print("#pragma once")
    print("#include <cstdint>")
    print()
    print("namespace coda::sm90 {")
    print()
    for n in SS_SHAPES:
        print(ss_wrapper(n))
        print()
    for n in RS_SHAPES:
        print(rs_wrapper(n))
        print()
    for a, b in FP8_PAIRS:
        for n in FP8_SHAPES:
            print(fp8_wrapper(n, a, b))
            print()
    print("}  // namespace coda::sm90")


if __name__ == "__main__":
    main()
