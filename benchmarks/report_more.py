"""BENCHMARKS.md sections for the second milestone's benchmarks: files on the server
(bench_files.py), Hugging Face models (bench_hf.py), the per-op A/B (ab_per_op.py) and
replayed steps (bench_replay.py).

Kept apart from report.py so each stays one screenful of formatting per benchmark."""

from __future__ import annotations

from typing import Any


def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _yes(flag: bool | None) -> str:
    return "–" if flag is None else ("yes" if flag else "**no**")


def _med(d: dict | None) -> float | None:
    return None if not d else d.get("median")


def section_files(doc: dict[str, Any]) -> list[str]:
    t = doc["targets"]
    return [
        "## Files on the server (`bench_files.py`)",
        "",
        f"{doc['workload']}.",
        "",
        "| | GB/s | with one full read on the server | target | met? |",
        "| --- | --- | --- | --- | --- |",
        f"| `rgpu.files.load_file` (read on the server) | {_f(doc['load_gb_per_s'])} | "
        f"{_f(doc['load_with_read_gb_per_s'])} | ≥ {t['load_gb_per_s']:g} GB/s | "
        f"{_yes(doc['load_gb_per_s'] >= t['load_gb_per_s'])} |",
        f"| the same tensors uploaded from the client | {_f(doc['upload_gb_per_s'])} | "
        f"{_f(doc['upload_with_read_gb_per_s'])} | – | – |",
        f"| load ÷ upload speed | {_f(doc['load_over_upload_speed'], 1)}× | "
        f"{_f(doc['load_over_upload_speed_with_read'], 1)}× | ≥ {t['load_over_upload_speed']:g}× | "
        f"{_yes(doc['load_over_upload_speed_with_read'] >= t['load_over_upload_speed'])} |",
        f"| bytes on the wire per GiB loaded | {doc['wire_bytes_per_gib_loaded']:,.0f} | – | "
        f"≤ {t['wire_bytes_per_gib_loaded']:,} | "
        f"{_yes(doc['wire_bytes_per_gib_loaded'] <= t['wire_bytes_per_gib_loaded'])} |",
        "",
        "On a CPU server a safetensors load maps the file copy-on-write, so the first column is "
        "the mapping; the second includes touching every page once, which is the fair comparison "
        "with an upload (its bytes are in memory when it returns).",
        "",
    ]


def section_hf(doc: dict[str, Any]) -> list[str]:
    lines = [
        "## Hugging Face models (`bench_hf.py`)",
        "",
        f"transformers {doc.get('transformers', '?')}; small configs of GPT-2, Llama (grouped-query "
        "attention), BERT (masked LM, a padding mask) and ViT, AdamW, `loss.item()` every step; "
        "rgpu and local CPU torch take turns.",
        "",
        "| model | rgpu ms/step | local ms/step | ratio | target | messages/step | waits/step "
        "| client CPU ms/step | server CPU ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in doc.get("training", {}).items():
        lines.append(
            f"| {name} | {_f(_med(r['rgpu_ms_per_step']), 1)} | "
            f"{_f(_med(r['local_ms_per_step']), 1)} | {_f(r['ratio_of_medians'])}× | "
            f"≤ {r['target_ratio']:g}× ({_yes(r['meets_target'])}) | "
            f"{r['messages_per_step']:.0f} | {r['waits_per_step']:.2f} | "
            f"{_f(_med(r['client_cpu_ms_per_step']), 1)} | "
            f"{_f(_med(r['server_cpu_ms_per_step']), 1)} |"
        )
    trained = doc.get("training_compiled", {})
    if trained:
        lines += [
            "",
            "The same steps with rgpu's model under `torch.compile(model, "
            "backend=rgpu.compile_backend())` (forward and backward one shipped graph each), "
            "against the same eager step on local CPU torch; warm-up: the first two steps, "
            "compiling included:",
            "",
            "| model | rgpu ms/step | local ms/step | ratio | target | messages/step | "
            "client CPU ms/step | server CPU ms/step | warm-up s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in trained.items():
            lines.append(
                f"| {name} | {_f(_med(r['rgpu_ms_per_step']), 1)} | "
                f"{_f(_med(r['local_ms_per_step']), 1)} | {_f(r['ratio_of_medians'])}× | "
                f"≤ {r['target_ratio']:g}× ({_yes(r['meets_target'])}) | "
                f"{r['messages_per_step']:.0f} | "
                f"{_f(_med(r['client_cpu_ms_per_step']), 1)} | "
                f"{_f(_med(r['server_cpu_ms_per_step']), 1)} | {r.get('warm_up_s', 0):.1f} |"
            )
    lines += [
        "",
        "Greedy decoding with the KV cache (`generate`, the same tokens as local CPU torch):",
        "",
        "| model | rgpu ms/token | local ms/token | ratio | target | messages/token | "
        "waits/token | tokens equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in doc.get("decode", {}).items():
        lines.append(
            f"| {name} | {_f(_med(r['rgpu_ms_per_token']))} | "
            f"{_f(_med(r['local_ms_per_token']))} | {_f(r['ratio_of_medians'])}× | "
            f"≤ {r['target_ratio']:g}× ({_yes(r['meets_target'])}) | "
            f"{r['messages_per_token']:.1f} | {r['waits_per_token']:.3f} | "
            f"{_yes(r['tokens_equal_cpu'])} |"
        )
    compiled = doc.get("decode_compiled", {})
    if compiled:
        lines += [
            "",
            "The same decoding as transformers' fast-generation recipe: "
            '`cache_implementation="static"` and `model.forward = torch.compile(model.forward, '
            "backend=rgpu.compile_backend(), dynamic=False)`; ratio against local CPU torch's "
            "default decoding above (and its static cache, run eagerly):",
            "",
            "| model | rgpu ms/token | local ms/token (static) | ratio (to static) | target | "
            "messages/token | client CPU ms/token | first call s | tokens equal |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in compiled.items():
            lines.append(
                f"| {name} | {_f(_med(r['rgpu_ms_per_token']))} | "
                f"{_f(_med(r['local_ms_per_token']))} "
                f"({_f(_med(r['local_static_ms_per_token']))}) | "
                f"{_f(r['ratio_of_medians'])}× ({_f(r['ratio_to_local_static'])}×) | "
                f"≤ {r['target_ratio']:g}× ({_yes(r['meets_target'])}) | "
                f"{r['messages_per_token']:.1f} | "
                f"{_f(_med(r['client_cpu_ms_per_token']))} | {r['first_call_s']:.1f} | "
                f"{_yes(r['tokens_equal_cpu'])} |"
            )
    slow = doc.get("decode_over_a_slow_link", {})
    if slow:
        rtt = next(iter(slow.values()))["rtt_ms"]
        lines += [
            "",
            f"Greedy decoding through `python -m rgpu.netem` at {rtt:g} ms RTT, against the "
            "ideal of one round trip per token (1 / (RTT + local time per token)). Tokens per "
            "second past a call's fixed cost (the waits transformers' `generate` spends before "
            "its loop and the last one), from a long and a short call; in brackets, the whole "
            f"call of {next(iter(slow.values()))['tokens']} tokens:",
            "",
            "| model | stop check runs ahead (default) | one wait per token (lookahead 0) | "
            "one-wait ideal | speed-up over the ideal | target |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in slow.items():
            ahead = next(
                v for k, v in r.items() if k.startswith("lookahead_") and k != "lookahead_0"
            )
            lines.append(
                f"| {name} | {ahead['marginal_tokens_per_second']:.1f} tokens/s "
                f"({ahead['tokens_per_second']:.1f}; {ahead['waits_per_token']:.2f} waits/token) | "
                f"{r['lookahead_0']['marginal_tokens_per_second']:.1f} tokens/s "
                f"({r['lookahead_0']['tokens_per_second']:.1f}) | "
                f"{r['one_wait_per_token_ideal_tokens_per_second']:.1f} tokens/s | "
                f"{ahead['speedup_over_one_wait_per_token_ideal']:.1f}× | "
                f"≥ {r['target_speedup']:g}× ({_yes(r['meets_target'])}) |"
            )
    base = doc.get("baseline")
    if base:
        lines += [
            "",
            f"The same benchmark at {base['commit']} ({base['note']}): ratio, messages, "
            "client and server CPU per step or token, then → now:",
            "",
            "| step | ratio then → now | messages then → now | client CPU ms then → now "
            "| server CPU ms then → now |",
            "| --- | --- | --- | --- | --- |",
        ]
        for kind, unit in (("training", "step"), ("decode", "token")):
            for name, old in base.get(kind, {}).items():
                new = doc[kind][name]
                server = f"server_cpu_ms_per_{unit}"
                lines.append(
                    f"| {kind} {name} | {old['ratio_of_medians']:.2f}× → "
                    f"{new['ratio_of_medians']:.2f}× | {old[f'messages_per_{unit}']:.1f} → "
                    f"{new[f'messages_per_{unit}']:.1f} | "
                    f"{old[f'client_cpu_ms_per_{unit}']:.1f} → "
                    f"{new[f'client_cpu_ms_per_{unit}']['median']:.1f} | "
                    + (
                        f"{old[server]:.1f} → {new[server]['median']:.1f} |"
                        if server in old
                        else "– |"
                    )  # fmt: skip
                )
    return lines + [""]


def section_ab(doc: dict[str, Any]) -> list[str]:
    """ab_per_op.py: two commits side by side."""
    (a, ra), (b, rb) = list(doc["revisions"].items())[:2]
    lines = [
        "## Per-op cost, two commits side by side (`ab_per_op.py`)",
        "",
        f"`{a}` (A) against `{b}` (B): fresh processes alternating, the embedded CPU server; "
        "medians over rounds. Ratios are B / A (below 1: B is faster).",
        "",
        "| measure | A | B | B / A |",
        "| --- | --- | --- | --- |",
        f"| `x + 1` wall µs/op | {ra['median_wall_us_per_op']:.2f} | "
        f"{rb['median_wall_us_per_op']:.2f} | {doc['ratio_b_over_a']:.3f} |",
        f"| client CPU µs/op | {ra['median_client_cpu_us_per_op']:.2f} | "
        f"{rb['median_client_cpu_us_per_op']:.2f} | {doc['cpu_ratio_b_over_a']:.3f} |",
        f"| MLP step ms | {ra['median_mlp_ms_per_step']:.3f} | {rb['median_mlp_ms_per_step']:.3f} "
        f"| {doc['mlp_ratio_b_over_a']:.3f} |",
    ]
    if "sync_ratio_b_over_a" in doc:
        lines.append(
            f"| `synchronize()` round trip µs | {ra['median_sync_us']:.0f} | "
            f"{rb['median_sync_us']:.0f} | {doc['sync_ratio_b_over_a']:.3f} |"
        )
    if "llama_cpu_ratio_b_over_a" in doc:
        lines.append(
            f"| Llama training step, client CPU ms "
            f"({ra['llama_messages_per_step']:.0f} / {rb['llama_messages_per_step']:.0f} messages) "
            f"| {ra['median_llama_client_cpu_ms_per_step']:.1f} "
            f"| {rb['median_llama_client_cpu_ms_per_step']:.1f} "
            f"| {doc['llama_cpu_ratio_b_over_a']:.3f} |"
        )
    lines.append("")
    return lines


def section_replay(doc: dict[str, Any]) -> list[str]:
    """bench_replay.py: plain RUNs against replayed steps, taking turns in one session."""
    po = doc["per_op"]
    pl, rp = po["plain"], po["replayed"]
    lines = [
        "## Replayed steps (`bench_replay.py`)",
        "",
        f"{po['workload']}; plain RUNs and replayed steps (`rgpu.settings.replay`) take turns "
        "in one session, next to the same loop on local CPU torch. Overhead: server CPU per op "
        "above the local op's own CPU time.",
        "",
        "| per op | server CPU µs | overhead µs | client CPU µs | wall µs | messages/op |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| local CPU torch | {_f(_med(po['local_cpu_us_per_op']))} | – | – | – | – |",
    ]
    for name, r in (("plain RUNs", pl), ("replayed", rp)):
        lines.append(
            f"| {name} | {_f(_med(r['server_cpu_us_per_op']))} | "
            f"{_f(r['server_overhead_us_per_op'])} | {_f(_med(r['client_cpu_us_per_op']))} | "
            f"{_f(_med(r['wall_us_per_op']))} | {r['messages_per_op']:.4f} |"
        )
    lines += [
        "",
        f"Replayed overhead ÷ plain: {_f(po['server_overhead_replayed_over_plain'])} (target "
        f"≤ {po['target_overhead_ratio']:.2f}: {_yes(po['meets_target'])}).",
        "",
        "| workload | mode | ms/unit | client CPU ms | server CPU ms | messages | waits "
        "| replayed ops | same reads |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for group, unit in (("training", "step"), ("decode", "call")):
        for name, r in doc.get(group, {}).items():
            label = f"{name} ({group}, per {unit})"
            for mode in ("plain", "replayed"):
                m = r[mode]
                lines.append(
                    f"| {label} | {mode} | {_f(_med(m[f'ms_per_{unit}']), 1)} | "
                    f"{_f(_med(m[f'client_cpu_ms_per_{unit}']), 1)} | "
                    f"{_f(_med(m[f'server_cpu_ms_per_{unit}']), 1)} | "
                    f"{m[f'messages_per_{unit}'][-1]:.1f} | {m[f'waits_per_{unit}'][-1]:.1f} | "
                    f"{m[f'replayed_ops_per_{unit}'][-1]:.1f} | "
                    f"{_yes(r['plain_and_replayed_read_the_same'])} |"
                )
                label = ""
    return lines + [""]
