"""GPU check of every kernel in ``dspine.kernels``: correctness vs ``*_ref`` and timing.

    python -m dspine.kernels.bench_gpu                 # CUDA: 27B shapes, batch 1 and 8
    python -m dspine.kernels.bench_gpu --batches 8 --iters 20
    python -m dspine.kernels.bench_gpu --cpu-smoke     # tiny shapes under TRITON_INTERPRET=1 (CI)

For each kernel (bridge, draft_attention, fp8_head_topk, tail_tables,
tail_chain, paged_attention; a missing one is skipped with a message) it runs ``<op>_triton``
and ``<op>_ref`` on the same random inputs, compares them (relative RMS error
for floats, exact equality for ids), then times both: median of ``--iters``
runs after ``--warmup`` runs, CUDA events. Achieved bandwidth is the kernel's
estimated unique HBM bytes / median time, printed next to a measured
device-to-device copy (read + write bytes / time). Shapes: H=5120, D=1024,
M=512, V=248,320, BS=16, K=16, R=128, 32 q / 8 kv heads of 128, context 8192.
The target's library paths are checked the same way when their libraries
import: ``paged_attention_flash`` (flash-attn's paged kernel, pages of 256)
and ``gated_delta_rule_fla`` (flash-linear-attention vs the torch delta rule);
otherwise they print "skipped".
Exit code: 0 when every present kernel matches its reference (or no CUDA
device: nothing to check), 1 on a mismatch or error.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

SHAPES_27B = dict(H=5120, D=1024, M=512, V=248_320, BS=16, K=16, R=128, HQ=32, HKV=8, HD=128, CTX=8192)
SHAPES_SMOKE = dict(H=40, D=12, M=10, V=150, BS=4, K=4, R=16, HQ=4, HKV=2, HD=16, CTX=20)


@dataclass
class Case:
    name: str
    run_kernel: object  # () -> outputs
    run_ref: object
    compare: object  # (ref_out, kernel_out) -> (ok: bool, detail: str)
    nbytes: int  # estimated unique bytes the kernel must move


def rel_rms(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    if torch.isnan(out).any():
        return math.inf
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _close(limit: float):
    def cmp(ref, out):
        pairs = list(zip(ref, out)) if isinstance(ref, (tuple, list)) else [(ref, out)]
        errs = [rel_rms(r, o) for r, o in pairs if r.is_floating_point()]
        return max(errs) <= limit, "rel_rms " + " ".join(f"{e:.2e}" for e in errs) + f" (limit {limit:.0e})"
    return cmp


def bytes_of(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def timeit(fn, iters: int, warmup: int, cuda: bool) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(dev, iters: int, warmup: int, cuda: bool, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), iters, warmup, cuda)
    return 2 * nbytes / t


# ----------------------------------------------------------------------------- cases
def case_bridge(kmod, s, nb, dev, dt):
    H, D, M, V, BS = s["H"], s["D"], s["M"], s["V"], s["BS"]
    g = torch.Generator(device=dev).manual_seed(42)
    rn = lambda *shape, std=1.0: (torch.randn(*shape, generator=g, device=dev) * std).to(dt)  # noqa: E731
    cb = torch.randn(V, D, generator=g, device=dev)
    args = (rn(nb, BS, H), torch.randint(0, V, (nb,), generator=g, device=dev), (cb / cb.norm(dim=1, keepdim=True)).to(dt),
            rn(D, H, std=H ** -0.5), rn(M, D, std=D ** -0.5), rn(M, D, std=D ** -0.5), rn(M, D, std=D ** -0.5),
            rn(M, std=0.1), rn(H, M, std=M ** -0.5), 1e-6)
    nbytes = bytes_of(args[0]) * 2 + bytes_of(*args[3:9]) + nb * D * args[2].element_size()
    return Case("bridge", lambda: kmod.bridge_triton(*args), lambda: kmod.bridge_ref(*args),
                _close(2e-2 if dt == torch.bfloat16 else 1e-5), nbytes)


def case_draft_attention(kmod, s, nb, dev, dt):
    BS, HQ, HKV, HD, CTX = s["BS"], s["HQ"], s["HKV"], s["HD"], s["CTX"]
    g = torch.Generator(device=dev).manual_seed(42)
    rn = lambda *shape: torch.randn(*shape, generator=g, device=dev).to(dt)  # noqa: E731
    S = nb * CTX + 1  # slot 0 is the padding sink
    perm = torch.randperm(S - 1, generator=g, device=dev) + 1
    slots = perm.view(nb, CTX)
    args = (rn(nb, BS, HQ, HD), rn(nb, BS, HKV, HD), rn(nb, BS, HKV, HD), rn(S, HKV, HD), rn(S, HKV, HD),
            slots, torch.full((nb,), CTX, dtype=torch.int64, device=dev), CTX, 1.0 / math.sqrt(HD))
    nbytes = 2 * nb * CTX * HKV * HD * args[3].element_size() + bytes_of(*args[:3]) * 2 // 3 * 2 + bytes_of(slots)
    return Case("draft_attention", lambda: kmod.draft_attention_triton(*args),
                lambda: kmod.draft_attention_ref(*args), _close(2e-2 if dt == torch.bfloat16 else 1e-4), nbytes)


def case_fp8_head_topk(kmod, s, nb, dev, dt, smoke):
    H, V, K, R, BS = s["H"], s["V"], s["K"], s["R"], s["BS"]
    n = nb * (BS - 1)
    g = torch.Generator(device=dev).manual_seed(42)
    head = torch.randn(V, H, generator=g, device=dev).to(dt)
    hidden = torch.randn(n, H, generator=g, device=dev).to(dt)
    head_fp8, scale = kmod.quantize_head_fp8(head)
    tiles = dict(tile_v=64, block_v=32, block_h=16) if smoke else {}

    def cmp(ref, out):
        same = (ref[0] == out[0]).all(dim=1)
        err = rel_rms(ref[1], out[1])
        # a row may legitimately differ when the kernel's bf16 scan and the fp32 reference put a
        # different token at the R boundary and that token belongs to the top K; require >= 90% rows.
        ok = same.float().mean().item() >= (1.0 if smoke else 0.9) and err <= 1e-2
        return ok, f"id rows equal {int(same.sum())}/{n}, logits rel_rms {err:.2e}"

    nbytes = bytes_of(head_fp8, scale, hidden) + 2 * n * V * 4 + n * R * H * head.element_size()
    return Case("fp8_head_topk", lambda: kmod.fp8_head_topk_triton(hidden, head_fp8, scale, head, R, K, **tiles),
                lambda: kmod.fp8_head_topk_ref(hidden, head_fp8, scale, head, R, K), cmp, nbytes)


def case_tail_tables(kmod, s, nb, dev, dt):
    H, D, M, V, BS, K = s["H"], s["D"], s["M"], s["V"], s["BS"], s["K"]
    g = torch.Generator(device=dev).manual_seed(42)
    rn = lambda *shape, std=1.0: torch.randn(*shape, generator=g, device=dev) * std  # noqa: E731
    cb = rn(V, D)
    cb = cb / cb.norm(dim=1, keepdim=True)
    gate_recv, gate_pred, value_proj = (rn(M, D, std=D ** -0.5) for _ in range(3))
    write_proj, head, gw = rn(H, M, std=M ** -0.5), rn(V, H, std=0.05).to(dt), rn(H).abs() + 0.5
    thw, tgv, gram = kmod.precompute_tail_tables(cb, gate_pred, value_proj, write_proj, head, gw, dtype=dt)
    x = rn(nb, BS, H)
    cand = torch.randint(0, V, (nb, BS - 1, K), generator=g, device=dev)
    pred = torch.cat([torch.randint(0, V, (nb, 1, 1), generator=g, device=dev).expand(nb, 1, K), cand[:, :-1]], 1)
    args = (x.to(dt), x.pow(2).mean(-1).sqrt(), rn(nb, BS, D), cand, pred.contiguous(), gate_recv.to(dt),
            rn(M, std=0.1).to(dt), tgv, thw, gram, write_proj.to(dt), head, gw.to(dt), 1e-6)
    rows = nb * (BS - 1)
    nbytes = (bytes_of(args[0]) + rows * K * (H * head.element_size() + 3 * M * tgv.element_size())
              + bytes_of(gram) + bytes_of(args[5], args[10]))
    return Case("tail_tables", lambda: kmod.tail_tables_triton(*args), lambda: kmod.tail_tables_ref(*args),
                _close(1e-3 if dt == torch.bfloat16 else 1e-5), nbytes)


def case_tail_chain(kmod, s, nb, dev, dt):
    BS, K = s["BS"], s["K"]
    g = torch.Generator(device=dev).manual_seed(42)
    scores = torch.randn(nb, BS - 1, K, K, generator=g, device=dev) * 2
    cand = torch.randint(0, s["V"], (nb, BS - 1, K), generator=g, device=dev)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * nb, dtype=torch.float64, device=dev)[:nb]
    top_k = torch.tensor([0, 0, 5, 0] * nb, device=dev)[:nb]
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8] * nb, dtype=torch.float64, device=dev)[:nb]
    u = torch.rand(nb, BS - 1, generator=g, device=dev, dtype=torch.float64)
    args = (scores, cand, temperature, top_k, top_p, u)

    def cmp(ref, out):
        same = torch.equal(ref[0], out[0]) and torch.equal(ref[1], out[1])
        err = rel_rms(ref[2], out[2])
        return same and err <= 1e-12, f"ids/choices equal {same}, q rel_rms {err:.2e}"

    return Case("tail_chain", lambda: kmod.tail_chain_triton(*args), lambda: kmod.tail_chain_ref(*args), cmp,
                bytes_of(scores) // K + bytes_of(cand) // K + nb * (BS - 1) * (K * 8 + 16))


class Unavailable(Exception):
    """A case whose kernel library is not installed here (reported as skipped, not as a failure)."""


def case_paged_attention(kmod, s, nb, dev, dt, smoke):
    """The target's full attention over the paged pool: a 16-row verify of each request at context CTX.
    27B target shapes: 24 q / 4 kv heads of 256. Pages of 16 (Triton) or 256 (flash-attn 2)."""
    hq, hkv, hd, T, ctx = (4, 2, 16, 4, 20) if smoke else (24, 4, 256, 16, s["CTX"])
    flash = kmod.__name__.endswith("_flash")
    page = 256 if flash else 16
    if flash and kmod.flash_attn_kvcache() is None:
        raise Unavailable("flash_attn is not installed (see the README: GPU install)")
    g = torch.Generator(device=dev).manual_seed(42)
    width = -(-(ctx + T) // page)
    num_blocks = nb * width + 1  # block 0: the pool's sink
    table = (torch.randperm(num_blocks - 1, generator=g, device=dev) + 1).view(nb, width).int()
    args = (torch.randn(nb, T, hq, hd, generator=g, device=dev).to(dt),
            torch.randn(num_blocks, page, hkv, hd, generator=g, device=dev).to(dt),
            torch.randn(num_blocks, page, hkv, hd, generator=g, device=dev).to(dt),
            table, torch.full((nb,), ctx, dtype=torch.int32, device=dev), hd ** -0.5)
    kernel = kmod.paged_attention_flash if flash else kmod.paged_attention_triton
    nbytes = 2 * nb * (ctx + T) * hkv * hd * args[1].element_size() + 2 * bytes_of(args[0])
    return Case("paged_attention_flash" if flash else "paged_attention", lambda: kernel(*args),
                lambda: kmod.paged_attention_ref(*args), _close(2e-2 if dt == torch.bfloat16 else 1e-4), nbytes)


def case_gated_delta_rule(kmod, s, nb, dev, dt, smoke):
    """The target's GDN recurrence through flash-linear-attention vs the torch path: a 16-row verify
    (the chunked kernel). 27B shapes: 16 key / 48 value heads of 128."""
    if dev.type != "cuda" or kmod.fla_gated_delta_rule() is None:
        raise Unavailable("flash-linear-attention (fla-core) not importable, or no CUDA")
    from dspine.replica.models.gated_deltanet import delta_rule_chunked, l2norm

    hk, hv, d, T = (2, 4, 16, 16) if smoke else (16, 48, 128, 16)
    g = torch.Generator(device=dev).manual_seed(42)
    rn = lambda *shape: torch.randn(*shape, generator=g, device=dev)  # noqa: E731
    q, k = l2norm(rn(nb, T, hk, d)) * d ** -0.5, l2norm(rn(nb, T, hk, d))
    v, log_decay = rn(nb, T, hv, d), -torch.rand(nb, T, hv, generator=g, device=dev)
    beta, state = torch.rand(nb, T, hv, generator=g, device=dev), rn(nb, hv, d, d) * 0.1

    def ref():
        rep = hv // hk
        qe, ke = (t.repeat_interleave(rep, 2).transpose(1, 2) for t in (q, k))
        out, final = delta_rule_chunked(qe, ke, v.transpose(1, 2), log_decay.transpose(1, 2),
                                        beta.transpose(1, 2), state)
        return out.transpose(1, 2), final

    nbytes = bytes_of(q, k, v, log_decay, beta) + 2 * bytes_of(state) + bytes_of(v)
    return Case("gated_delta_rule_fla", lambda: kmod.fla_delta_rule(q, k, v, log_decay, beta, state), ref,
                _close(1e-2), nbytes)


CASES = [  # (kernel module, builder, needs the smoke flag[, label])
    ("bridge", case_bridge, False),
    ("draft_attention", case_draft_attention, False),
    ("fp8_head_topk", case_fp8_head_topk, True),
    ("tail_tables", case_tail_tables, False),
    ("tail_chain", case_tail_chain, False),
    ("paged_attention", case_paged_attention, True),
    ("paged_attention", case_paged_attention, True, "paged_attention_flash"),
    ("dspine.replica.models.gdn_backend", case_gated_delta_rule, True, "gated_delta_rule_fla"),
]


class _Named:
    """A kernel module seen under one of its backends' names (``__name__``), attributes forwarded."""

    def __init__(self, module, name: str):
        self._module, self.__name__ = module, name

    def __getattr__(self, attr):
        return getattr(self._module, attr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="number of draft blocks (requests)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--only", nargs="*", default=None, help="kernel names to run")
    a = ap.parse_args(argv)

    if a.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            # Triton reads TRITON_INTERPRET when the kernels are decorated (at import of
            # dspine.kernels, which `python -m` has already done): rerun in a fresh process.
            import subprocess

            env = dict(os.environ, TRITON_INTERPRET="1")
            cmd = [sys.executable, "-m", "dspine.kernels.bench_gpu", *(argv if argv is not None else sys.argv[1:])]
            return subprocess.run(cmd, env=env).returncode
        shapes, dev, dt, cuda = SHAPES_SMOKE, torch.device("cpu"), torch.float32, False
        batches, iters, warmup = [1, 2], 1, 0
    else:
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device on this machine; nothing to check "
                  "(run with --cpu-smoke for the tiny interpreter run).")
            return 0
        shapes, dev, dt, cuda = SHAPES_27B, torch.device("cuda"), torch.bfloat16, True
        batches, iters, warmup = a.batches, a.iters, a.warmup
        torch.backends.cuda.matmul.allow_tf32 = False

    import importlib

    print(f"bench_gpu: device {torch.cuda.get_device_name() if cuda else 'cpu (TRITON_INTERPRET=1)'}, "
          f"shapes {shapes}, dtype {dt}, iters {iters} (+{warmup} warm-up)")
    copy_bw = copy_bandwidth(dev, max(iters, 1), warmup, cuda, nbytes=(1 << 30) if cuda else (1 << 20))
    print(f"device-to-device copy: {copy_bw / 1e9:,.1f} GB/s (read + write)")
    failures = 0
    header = f"{'kernel':<16} {'NB':>3} {'kernel ms':>10} {'ref ms':>10} {'speedup':>8} {'GB/s':>9} {'% copy':>7}  check"
    print(header)
    for module_name, build, needs_smoke, *label in CASES:
        name = label[0] if label else module_name
        if a.only and name not in a.only:
            continue
        try:
            if "." in module_name:  # a dispatch module outside kernels/ (its reference is the torch path)
                kmod = importlib.import_module(module_name)
            else:
                kmod = importlib.import_module(f"dspine.kernels.{module_name}")
                for attr in (f"{module_name}_triton", f"{module_name}_ref"):
                    getattr(kmod, attr)
            if label:  # a second backend of the same module: the builder picks it by this name
                kmod = _Named(kmod, name)
        except (ImportError, AttributeError) as e:
            print(f"{name:<16} skipped: kernel not available ({e})")
            continue
        for nb in batches:
            try:
                case = build(kmod, shapes, nb, dev, dt, a.cpu_smoke) if needs_smoke else build(kmod, shapes, nb, dev, dt)
                out, ref = case.run_kernel(), case.run_ref()
                ok, detail = case.compare(ref, out)
                tk = timeit(case.run_kernel, iters, warmup, cuda)
                tr = timeit(case.run_ref, iters, warmup, cuda)
                bw = case.nbytes / tk
                print(f"{name:<16} {nb:>3} {tk * 1e3:>10.3f} {tr * 1e3:>10.3f} {tr / tk:>7.1f}x "
                      f"{bw / 1e9:>9.1f} {100 * bw / copy_bw:>6.1f}%  {'OK' if ok else 'MISMATCH'} {detail}")
                failures += not ok
                del case, out, ref
                if cuda:
                    torch.cuda.empty_cache()
            except Unavailable as e:
                print(f"{name:<16} {nb:>3} skipped: {e}")
                break
            except Exception as e:  # report and go on: one broken kernel must not hide the others
                print(f"{name:<16} {nb:>3} ERROR {type(e).__name__}: {e}")
                failures += 1
    print(f"bench_gpu: {'all kernels match their references' if not failures else f'{failures} failure(s)'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
