#!/usr/bin/env bash
# Where a decode GEMM's warps wait, instruction by instruction: ncu's warp-state samples of one
# GEMM launch (the rule's build, gate_up unless NCU_SHAPE is set) exported per SASS instruction
# (--page source --print-source sass --csv), then summed by region of the step loop
# (benchmarks/stalls_by_region.py). Usage (repository root, on the GPU):
#   benchmarks/ncu_sass.sh OUT_DIR PATH M [M ...]     PATH: wgmma (decode_wgmma) or fp8 (decode_fp8)
set -uo pipefail
o=${1:?output folder}; path=${2:?path: wgmma or fp8}; shift 2; mkdir -p "$o"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
kernel=$([ "$path" = fp8 ] && echo _decode_fp8_kernel || echo _decode_wgmma_kernel)
shape=${NCU_SHAPE:-gate_up}
for m in "$@"; do
  rep="$o/rep_${path}_${shape}_m$m"
  timeout 150 ncu --clock-control none -k "regex:$kernel" --launch-skip 6 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SchedulerStats --section LaunchStats \
    --section Occupancy --import-source no -o "$rep" \
    python benchmarks/profile_decode.py --path "$path" --shape "$shape" --m "$m" --calls 8 \
    > "$o/ncu_run_${path}_${shape}_m$m.txt" 2>&1
  echo "$path $shape M=$m rc=$?"
  ncu -i "$rep.ncu-rep" --page details > "$o/ncu_${path}_${shape}_m$m.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass | gzip > "$o/sass_${path}_${shape}_m$m.csv.gz"
  rm -f "$rep.ncu-rep"
  python benchmarks/stalls_by_region.py "$o/sass_${path}_${shape}_m$m.csv.gz" > "$o/regions_${path}_${shape}_m$m.txt" 2>&1
done
