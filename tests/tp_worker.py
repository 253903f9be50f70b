"""One rank of the tensor-parallel tests (tests/test_parallel.py starts two of these, as torchrun would).

    python tests/tp_worker.py OUT_FILE CASES_JSON

Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, joins a gloo group and runs each case:
``{"kind": "model", "dir": ...}`` records the sharded model's logits (fp32, and fp64 with exact
dequantized weights) and its greedy tokens; ``{"kind": "parallelize", ...}`` the logits of the
whole model split in memory; ``{"kind": "error", "dir": ..., ...}`` the exception ``load_model``
raised on this rank. Results go to OUT_FILE.rank<r> (torch.save).
"""
import datetime
import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import escha  # noqa: E402
from escha import ops  # noqa: E402
from escha.nn import set_matmul_path  # noqa: E402

PROMPT = [[3, 17, 99, 42, 7, 128]]


def exact_matmul(x, qw, norm=None, head_norm=None, **_):
    """norm(x) @ W_hat^T with the exact dequantized weight, in x's dtype (float64 here), then
    head_norm; the norms a projection applies when its layer's RMSNorms are folded into it."""
    if norm is not None:
        x = norm.apply(x)
    y = x @ escha.dequantize(qw).to(x.dtype).T
    return y if head_norm is None else head_norm.apply(y)


def greedy(model, n: int, **kwargs) -> torch.Tensor:
    prompt = torch.tensor(PROMPT)
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)[0, prompt.shape[1]:]


def outputs(model, new_tokens: int, static: bool = False) -> dict:
    """The model's fp32 logits and greedy tokens (reference codec), then its fp64 logits with exact
    weights; the same function serves the single-process reference in the test."""
    set_matmul_path(model, "reference")
    out = {}
    with torch.no_grad():
        out["logits"] = model(torch.tensor(PROMPT)).logits
        out["tokens"] = greedy(model, new_tokens)
        if static:
            out["tokens_static"] = greedy(model, new_tokens, cache_implementation="static")
        real = ops.matmul
        ops.matmul = exact_matmul
        try:
            out["logits64"] = model.double()(torch.tensor(PROMPT)).logits
        finally:
            ops.matmul = real
    return out


def run_model(case: dict) -> dict:
    model = escha.load_model(case["dir"])
    layers = {n: type(m).__name__ for n, m in model.named_modules() if ".0." in n and n.endswith("proj")}
    return dict(outputs(model, case["new_tokens"], case.get("static", False)), layers=layers)


def run_parallelize(case: dict) -> dict:
    """The whole model loaded on every rank, then split in memory."""
    from escha.parallel import parallelize
    model = parallelize(escha.load_model(case["dir"], tensor_parallel=False))
    set_matmul_path(model, "reference")
    with torch.no_grad():
        return {"logits": model(torch.tensor(PROMPT)).logits}


def run_error(case: dict, rank: int) -> dict:
    directory = case["dirs"][rank] if "dirs" in case else case["dir"]
    kwargs = {"device": case["devices"][rank]} if "devices" in case else {}
    try:
        escha.load_model(directory, **kwargs)
    except Exception as e:  # the test checks the type and message on every rank
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


def main() -> None:
    # A native abort prints every thread's Python stack into the log the test shows.
    faulthandler.enable()
    out_file, cases = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=float(os.environ.get("ESCHA_TEST_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    run = {"model": run_model, "parallelize": run_parallelize, "error": lambda c: run_error(c, rank)}
    results = []
    for i, case in enumerate(cases):
        results.append(run[case["kind"]](case))
        print(f"rank {rank}: case {i} ({case['kind']}) done", flush=True)
    torch.save(results, f"{out_file}.rank{rank}")
    # No rank tears its group down while another may still be in a collective (rank 0 also
    # serves the group's store).
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: finished", flush=True)
    # Skip the interpreter's teardown. A rank once aborted with "terminate called without an
    # active exception" and no Python error, the mark of a native thread (gloo's, the store's)
    # destroyed at exit; everything the test reads is written by now. Should an abort come
    # earlier, faulthandler's stacks and the case lines above say where.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
