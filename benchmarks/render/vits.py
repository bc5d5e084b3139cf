"""The ViT-S/16 serving section of docs/benchmarks.md (``benchmarks/serving/vits_bench.py``'s JSON)."""
from __future__ import annotations

from benchmarks.render.text import machine_line, sentence, table


def _row_name(name: str) -> str:
    runtime, _, precision = name.partition("/")
    label = {"torch": "torch eager (reference, not served)", "onnxruntime": "ONNX Runtime",
             "openvino": "OpenVINO"}[runtime]
    return f"{label} {precision}"


def vits_section(report: dict) -> list[str]:
    off, auto = report["offline"], report["offline"]["auto"]
    batches = list(off["batches"])
    names = list(off["batches"][batches[0]])
    rows = []
    for name in names:
        cells = [_row_name(name) + (" **(served)**" if name == auto["served"] else "")]
        for b in batches:
            r = off["batches"][b][name]
            cells.append(f"{r['images_per_s']:.1f}")
        cells.append(f"{off['batches'][batches[0]][name]['cosine_min_vs_ort_fp32']:.4f}")
        rows.append(cells)
    g = report["int8_guard"]
    lines = [
        f"Machine: {machine_line(report['machine'])}. Model: {report['model']}; {off['threads']} threads, "
        f"{off['tokens']} tokens (unmasked), runs interleaved in rounds. {sentence(report.get('note', ''))}".rstrip(),
        "",
        table(["runtime / precision", *[f"images/s at batch {b}" for b in batches], "min cosine to ORT fp32"], rows),
        "",
    ]
    if off.get("excluded"):
        lines += ["Not offered on this machine: " + "; ".join(f"{k} ({v})" for k, v in off["excluded"].items())
                  + ".", ""]
    choice = auto["choice"]
    verdicts = []
    for b in batches:
        a = auto[f"batch{b}"]
        verdicts.append(f"batch {b}: {a['served_images_per_s']:.1f} images/s = {a['served_vs_torch_bf16']:.2f} × "
                        f"torch bf16 ({a['torch_bf16_images_per_s']:.1f}), {a['served_vs_ort_fp32']:.2f} × ORT fp32")
    lines += [(f"`--precision auto` chose **{auto['served']}** here (start-up timing at batch {choice['batch']}: "
               + ", ".join(f"{n} {f['images_per_s']:.1f}" for n, f in choice["candidates"].items()
                           if "images_per_s" in f)
               + "). " + "; ".join(verdicts) + ". Targets: ≥ 0.9 × torch bf16 on an AMX CPU; ≥ 2 × ORT fp32 on "
               "an AVX2-only CPU."), "",
              (f"The bundle's int8 graph ({g['method']}) passed the export guard on {g['heldout_images']} held-out "
               f"images (min cosine {g['cosine_min']:.4f}, half-masked {g['cosine_masked_min']:.4f}; low-shot "
               + (", ".join(f"{k.replace('imgs_class', '-shot')} {v['int8']:.1f} vs {v['fp32']:.1f} %"
                            for k, v in g["lowshot"].items()) if g.get("lowshot") else "skipped")
               + ")" + ("; the weights are random, so the low-shot check compares random features."
                        if "random" in report["model"] else ".")), ""]
    if "http" in report:
        h = report["http"]
        rows = [[str(r["concurrency"]), f"{r['images_per_s']:.1f}", f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}"]
                for r in h["clients"]]
        lines += [(f"HTTP: a real `msn-serve` (`--precision auto`, served {h['served']}, `--max-batch-size "
                   f"{h['batch']} --max-wait-ms {h['max_wait_ms']:g}`), single-image JPEG clients on the same "
                   "machine:"), "",
                  table(["clients", "images/s", "p50 ms", "p99 ms"], rows), "",
                  (f"Offline (decode + preprocess + the same engine in one process): "
                   f"{h['offline_images_per_s']:.1f} images/s; HTTP at 64 clients / offline = "
                   f"**{h['http64_vs_offline']:.2f}** (target {h['target_ratio']}); p99 at 64 clients "
                   f"{h['p99_ms_64']:.0f} ms against the bound max-wait + 2 batch times = {h['p99_bound_ms']:.0f} ms."),
                  ""]
    return lines
