"""Where the fused fp8 kernel's warps wait (gate_up, 256 tokens): ncu's warp-state samples per SASS
instruction (``v2_ncu_source_gate_up_m256.csv.gz``: ``ncu --section SourceCounters`` exported with
``--page source --print-source sass --csv``), summed over the consumers' waits on "full" and over
the producer's loop (from its wait on "empty", the TRYWAIT before the one on the windows' first
barrier at +0x2c030, to the fence after its stores), with the producer's stall reasons.

    python benchmarks/results/fused_fp8_h200/stalls.py
"""
import csv
import gzip
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    with gzip.open(os.path.join(HERE, "v2_ncu_source_gate_up_m256.csv.gz"), "rt") as f:
        rows = list(csv.reader(f))
    hdr, data = rows[1], rows[2:]
    src, samples = hdr.index("Source"), hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    n = [float(r[samples] or 0) for r in data]
    total = sum(n)
    waits = [i for i, r in enumerate(data) if "TRYWAIT" in r[src]]
    win = next(i for i in waits if "0x2c030" in data[i][src])
    start = max(i for i in waits if i < win)
    # the loop's last fence (after its stores; the refill's fence comes earlier), and its NOP
    end = max(i for i, r in enumerate(data) if r[src].strip().startswith("FENCE.VIEW.ASYNC")) + 1

    def branch(i: int) -> int:  # the predicated branch that retries the wait at i
        return next(j for j in range(i + 1, len(data)) if data[j][src].strip().startswith("@!P")
                    and "BRA" in data[j][src])

    # the consumers' waits on "full" (their stage's barrier at +0x2c000), in the main code
    full = sum(n[branch(i)] for i in waits if i < start and "+0x2c000]" in data[i][src])
    prod = sum(n[start:end + 1])
    print(f"samples {total:.0f}: consumers waiting on 'full' {full / total:.1%}, producer loop {prod / total:.1%} "
          f"({end + 1 - start} instructions)")
    agg = {h[6:]: sum(float(r[hdr.index(h)] or 0) for r in data[start:end + 1]) for h in reasons}
    print("producer loop, by reason: " + ", ".join(f"{k} {v / prod:.1%}" for k, v in
                                                   sorted(agg.items(), key=lambda kv: -kv[1]) if v / prod >= 0.01))


if __name__ == "__main__":
    main()
