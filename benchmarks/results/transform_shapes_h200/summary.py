"""Tables of the three runs here: each point's call with the output transform's rule beside the
shape it replaced (min(16, M rounded up to a power of two) tokens a program, 4 warps), and run 3's
input-transform rule (64 programs) beside the one it would have replaced (132).

    python benchmarks/results/transform_shapes_h200/summary.py > benchmarks/results/transform_shapes_h200/summary.txt
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def out_rule(m: int, np_: int) -> int:  # escha.kernels.transforms.output_shape at d278162
    t = min(16, pow2(m))
    while t > 1 and (np_ // 128) * -(-m // t) < 512:
        t //= 2
    return t


def in_rule(m: int, blocks: int, programs: int) -> int:  # transforms.input_blocks_per_program
    ch = 32
    while ch > 1 and m * -(-blocks // ch) < programs:
        ch //= 2
    return ch


for run in ("run1_0abfa0d", "run2_d278162", "run3_1d20e8c"):
    d = json.load(open(os.path.join(HERE, run, "decode_wgmma.json")))
    print(f"## {run} (git {d['env']['git']}, {d['env']['gpu']}, {d['env']['date']}), µs, median of 5")
    print("| shape | M | bf16 cuBLAS | output before | output rule | change | call / bf16 | input 132 | input 64 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in d["points"]:
        us, m, np_ = p["us"], p["M"], p["N"]
        t_old, t_new = min(16, pow2(m)), out_rule(m, np_)
        if run == "run1_0abfa0d":  # the rule's arm is the shape before; the new one a variant
            old, new = us["wgmma"], us.get(f"out_t{t_new}w4", us["wgmma"])
        else:
            old, new = us.get(f"out_t{t_old}w4", us["wgmma"]), us["wgmma"]
        cols = [p["shape"], m, f"{us['cublas_bf16']:.1f}", f"{old:.1f} (t{t_old})", f"{new:.1f} (t{t_new})",
                f"{100 * (new / old - 1):+.1f}%", f"{new / us['cublas_bf16']:.3f}"]
        if run == "run3_1d20e8c":
            blocks = p["K"] // 128
            b132, b64 = in_rule(m, blocks, 132), in_rule(m, blocks, 64)
            cols += [f"{us.get(f'in_b{b132}', us['wgmma']):.1f} (b{b132})", f"{us['wgmma']:.1f} (b{b64})"]
        else:
            cols += ["", ""]
        print("| " + " | ".join(str(c) for c in cols) + " |")
    print()
