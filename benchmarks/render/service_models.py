"""docs/benchmarks.md, "Several models in one server" and "Bulk embedding without torch": from
``benchmarks/results/two_models.json`` (``python -m benchmarks.serving.two_models``) and
``benchmarks/results/embed_folder.json`` (``python -m benchmarks.serving.embed_folder``)."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.render.text import machine_line, table


def two_models_section(results: Path) -> list[str]:
    path = results / "two_models.json"
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    rows = []
    for i, rnd in enumerate(r["rounds"]):
        for name, alone in rnd["one_model"].items():
            shared = rnd["two_models"]["models"][name]
            rows.append([str(i), name, f"{alone['images_per_s']:.0f}", f"{shared['images_per_s']:.0f}",
                         f"{shared['of_share']:.2f}", f"{shared['p50_ms']:.0f} / {shared['p99_ms']:.0f}",
                         str(sum(v for k, v in shared["by_status"].items() if k != "200"))])
    replaced = [rnd["two_models"].get("replace") for rnd in r["rounds"] if rnd["two_models"].get("replace")]
    seconds = ", ".join(f"{x['seconds']:.2f} s" for x in replaced)
    replace = (f" Model `b` was replaced (`PUT /admin/models/b`, a new bundle loaded, gated and warmed) half-way "
               f"through each two-model phase: {', '.join(str(x['status']) for x in replaced)} in "
               f"{seconds}; requests lost: {r['lost_total']}."
               if replaced else "")
    return ["## Several models in one server", "", machine_line(r["machine"]), "",
            (f"`python -m benchmarks.serving.two_models --seconds {r['seconds']:g} --rounds {len(r['rounds'])}"
             f"{' --replace' if replaced else ''}`: {r['clients']} clients send `/embed` requests, first to a "
             "one-model server of each bundle alone, then to one server holding both (every client alternates "
             "between the models); phases alternate per round. `of share` is a model's images/s in the shared "
             "server over half its one-model figure." + replace), "",
            table(["round", "model", "alone img/s", "shared img/s", "of share", "shared p50 / p99 ms", "not 200"],
                  rows), ""]


def embed_folder_section(results: Path) -> list[str]:
    path = results / "embed_folder.json"
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    e, off, res = r["msn_embed"], r["offline_engine_images_per_s"], r["resume"]
    runtime = r["runtime"]
    runtime = f"{runtime['runtime']}/{runtime['precision']}, {runtime['how']}" if isinstance(runtime, dict) else runtime
    return ["## Bulk embedding without torch (`msn-embed`)", "", machine_line(r["machine"]), "",
            (f"`python -m benchmarks.serving.embed_folder`: `msn-embed` on {r['images']:,} PNGs "
             f"(`{Path(r['folder']).name}`), run in a process whose imports refuse torch, on the runtime "
             f"`msn-serve` chooses here ({runtime}), batch {r['batch_size']}, beside the same engine on the "
             "same images already decoded and preprocessed (measured before and after)."), "",
            table(["", "images/s"], [
                ["offline engine, pre-decoded tensors (before / after)", f"{off['before']:,.0f} / {off['after']:,.0f}"],
                ["decoding alone, one thread", f"{r['single_thread_decode_images_per_s']:,.0f}"],
                ["`msn-embed` over its run (listing, decoding, inference, writing)", f"{e['images_per_s_run']:,.0f}"],
                ["`msn-embed` over the whole process", f"{e['images_per_s_process']:,.0f}"],
                ["ratio to the offline engine", f"{r['ratio_to_offline_engine']:.2f}"]]), "",
            _ceiling(r), "",
            (f"Killed (SIGKILL) with {res['committed_at_kill']} shards committed and restarted: "
             f"{res['committed_shards_redone']} committed shards redone, same ids and vectors as the uninterrupted "
             f"run: {'yes' if res['same_result'] else 'NO'}."), ""]


def _ceiling(r: dict) -> str:
    """What the machine allows when decoding and inference share its cores (both measured above)."""
    cores = r["machine"].get("cpu_count") or 1
    engine_core_s = cores / r["offline_engine_images_per_s"]["mean"]  # the engine uses every core
    decode_core_s = 1 / r["single_thread_decode_images_per_s"]
    bound = cores / (engine_core_s + decode_core_s)
    return (f"On {cores} cores decoding takes its CPU time from the engine: with both figures above, at most "
            f"{bound:,.0f} images/s ({bound / r['offline_engine_images_per_s']['mean']:.2f} of the engine) would be "
            "possible if nothing else cost anything; the rest of the gap is preprocessing, thread hand-offs and "
            "writing.")
