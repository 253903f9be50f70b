"""Tables of benchmarks/results/host_trim_h100 from its result files (python summarize.py > summary.md).

host_ab_64e7d45: bench_host.py --host-only --rounds 10 at 64e7d45, four rounds, each round the
three trees one after another in their own processes (base ef008ca, mid d438fad, new 64e7d45);
per point the least round's host time (host_min) of each run, then the least and the median of the
four runs. e2e_eager_64e7d45: bench_e2e.py eager, 40 layers, mid and new in turn, twice.
"""
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
TREES = ("base", "mid", "new")


def host_table() -> list[str]:
    d = os.path.join(HERE, "host_ab_64e7d45")
    runs: dict[tuple[int, str], dict[str, list[float]]] = {}
    for tree in TREES:
        for r in range(1, 5):
            with open(os.path.join(d, f"host_{tree}_r{r}.json")) as f:
                for p in json.load(f)["points"]:
                    for arm, v in p["us"].items():
                        runs.setdefault((p["M"], arm), {}).setdefault(tree, []).append(v["host_min"])
    out = ["| M | call | base ef008ca | mid d438fad | new 64e7d45 | new / mid |", "|---|---|---|---|---|---|"]
    for (m, arm), by in sorted(runs.items()):
        cells = [f"{min(by[t]):.1f} ({statistics.median(by[t]):.1f})" for t in TREES]
        out.append(f"| {m} | {arm} | " + " | ".join(cells) + f" | {min(by['new']) / min(by['mid']):.2f} |")
    return out


def e2e_table() -> list[str]:
    d = os.path.join(HERE, "e2e_eager_64e7d45")
    out = ["| run | tree | bf16 ms a step, batch 1 / 8 | escha ms a step, batch 1 / 8 | escha / bf16 tokens/s |",
           "|---|---|---|---|---|"]
    for r in (1, 2):
        for tree in ("mid", "new"):
            with open(os.path.join(d, f"e2e_eager_{tree}_r{r}.json")) as f:
                res = json.load(f)
            ms = {(arm, row["batch"]): row["ms_per_step"] for arm, a in res["arms"].items() for row in a["rows"]}
            ratio = [ms[("bf16", b)] / ms[("escha", b)] for b in (1, 8)]
            out.append(f"| {r} | {tree} | {ms[('bf16', 1)]:.1f} / {ms[('bf16', 8)]:.1f} | {ms[('escha', 1)]:.1f} / "
                       f"{ms[('escha', 8)]:.1f} | {ratio[0]:.2f} / {ratio[1]:.2f} |")
    return out


if __name__ == "__main__":
    print("## Host time of one eager call, gate_up 17408 x 5120, µs: least (median) of four runs' least round\n")
    print("\n".join(host_table()))
    print("\n## Eager 40-layer model, each tree in its own process, in turn\n")
    print("\n".join(e2e_table()))
