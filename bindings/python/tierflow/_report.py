"""The statistics report: a dict that prints as a table and saves as JSON."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024.0 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    return f"{n:.2f} TiB"


def write_json_atomic(path: str, obj: Any, **dump_args: Any) -> None:
    """Writes `obj` as JSON so that a reader never sees a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tierflow-", suffix=".json.tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, **dump_args)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Report(dict):
    """tierflow's statistics: peak bytes per tier, bytes per link, prefetch hits and stalls."""

    def __str__(self) -> str:
        a = self["activations"]
        p = self["prefetch"]
        h = self["host_pool"]
        link = self["links"]
        o = self["optimizer"]
        rows = [
            ("GPU tier (" + self["device"] + ")", ""),
            ("  saved activations held, peak", fmt_bytes(a["device_bytes"]["peak"])),
            ("  saved activations held, now", fmt_bytes(a["device_bytes"]["current"])),
            ("host tier (pinned pool" + ("" if h["pinned"] else ", emulated: not page-locked") + ")", ""),
            ("  budget", fmt_bytes(h["budget_bytes"])),
            ("  in use, peak", fmt_bytes(h["in_use"]["peak"])),
            ("  reserved in slabs, peak", f'{fmt_bytes(h["reserved"]["peak"])} ({h["slab_allocations"]} slab allocations)'),
            ("  saved activations held, peak", fmt_bytes(a["host_bytes"]["peak"])),
            ("links", ""),
            ("  gpu -> host", f'{fmt_bytes(link["gpu_to_host_bytes"])} in {link["gpu_to_host_ops"]} copies'),
            ("  host -> gpu", f'{fmt_bytes(link["host_to_gpu_bytes"])} in {link["host_to_gpu_ops"]} copies'),
            ("saved tensors", ""),
            ("  saved / read", f'{a["packs"]} / {a["unpacks"]}'),
            ("  offloaded", f'{a["offloaded_blocks"]} storages, {fmt_bytes(a["offloaded_bytes"])}'),
            ("  forward waited for the copy window", f'{a["offload_waits"]} times ({a["offload_wait_ms"]:.2f} ms)'),
            ("  not copied: parameters / duplicates", f'{a["skipped_parameters"]} / {a["dedup_hits"]}'),
            ("  kept: small / no_offload / pool full", f'{a["kept_small"]} / {a["kept_region"]} / {a["host_fallbacks"]}'),
            ("prefetch", ""),
            ("  prefetched ahead", str(p["prefetched_blocks"])),
            ("  hits / forwarded", f'{p["hits"]} / {p["forwarded"]}'),
            ("  stalls", f'{p["stalls"]} ({p["stall_ms"]:.2f} ms waiting, {p["unprefetched"]} never prefetched)'),
            ("CPU optimizer", ""),
            ("  steps", f'{o["steps"]} ({o["step_ms"]:.1f} ms, {o["elements"]} element updates, {o["threads"] or "all"} threads, {o.get("isa", "?")})'),
        ]
        if a["nvme_bytes"]["peak"]:  # Note [Block residences]: blocks whose only copy was on NVMe
            rows.insert(rows.index(("links", "")), ("  saved activations on NVMe only, peak",
                                                    fmt_bytes(a["nvme_bytes"]["peak"])))
        pp = self.get("params")
        if pp:
            gpu_rows_end = rows.index(next(r for r in rows if r[0].startswith("host tier")))
            rows.insert(gpu_rows_end, ("  parameters on the device, peak",
                                                    f'{fmt_bytes(pp["device_peak_bytes"])} (between uses: host '
                                                    f'{fmt_bytes(pp["host_bytes"])}, NVMe {fmt_bytes(pp["nvme_bytes"])}; '
                                                    f'{pp["fetches"]} fetches, '
                                                    f'{pp["prefetch_hits"]} prefetched, {pp["stalls"]} stalls)'))
        sts = o.get("states")
        if sts and sts["elements"]:
            rows.append(("  states (master, moments)", f'{fmt_bytes(sts["bytes"])} on the {sts["tier"]} for '
                                                       f'{sts["elements"]} elements, {sts["format"]} moments '
                                                       f'({sts["bytes"] / sts["elements"]:.2f} bytes each)'))
        part = o.get("partition")
        if part:
            rows.append(("  partitioned across ranks",
                         f'rank {part["rank"]} of {part["world_size"]}: {part["owned_parameters"]} of '
                         f'{part["parameters"]} parameters, {part["owned_elements"]} of {part["elements"]} elements; '
                         f'{part["broadcasts"]} weight broadcasts ({fmt_bytes(part["broadcast_bytes"])}, '
                         f'{part["broadcast_host_ms"]:.1f} ms on the host)'))
        if o.get("steps_during_backward_off"):
            rows.append(("  steps during backward", "off: " + o["steps_during_backward_off"]))
        ov = o.get("overlap") or {}
        if ov:
            rows.append(("  stepped during backward", f'{ov["early_steps"]} (committed {ov["committed"]}, redone {ov["redone"]}, '
                                                       f'taken back {ov["taken_back"]}, held {ov["held"]})'))
        st = o.get("streaming") or {}
        if st:
            rows.append(("  gradient buckets", f'{st["buckets"]} of {fmt_bytes(st["bucket_bytes"])} ({st["bucket_count"]} '
                                               f'per backward), {fmt_bytes(st["grad_bytes_to_host"])} down, '
                                               f'{fmt_bytes(st["weight_bytes_to_device"])} of weights up'))
            if st.get("sized_link_bytes_per_s"):
                rows.append(("  bucket size from", f'link {st["sized_link_bytes_per_s"] / 1e9:.1f} GB/s, CPU AdamW '
                                                   f'{st["sized_cpu_grad_bytes_per_s"] / 1e9:.1f} GB/s of gradients, '
                                                   f'backward {st["sized_backward_ms"]:.1f} ms'))
            if st.get("grads_released"):
                rows.append(("  gradients freed on the device", f'{fmt_bytes(st["grad_bytes_freed"])} once on the host '
                                                                f'({st["grads_restored"]} put back)'))
            rows.append(("  CPU step during backward / in step()", f'{st["kernel_ms"]:.1f} ms / {st["step_kernel_ms"]:.1f} ms '
                                                                 f'(step() waited {st["step_wait_ms"]:.1f} ms, '
                                                                 f'weights waited {st["weight_wait_ms"]:.1f} ms)'))
        not_replayed = (self.get("plan") or {}).get("not_replayed")
        if not_replayed:  # Note [Replay side effects]: blocks swapped instead of recomputed, and why
            rows.append(("blocks not recomputed (side effects)", ""))
            rows += [(f"  block {i}", why) for i, why in sorted(not_replayed.items())]
        width = max(len(k) for k, _ in rows) + 2
        lines = ["tierflow report"]
        lines += [f"{k:<{width}}{v}" if v else k for k, v in rows]
        return "\n".join(lines)

    def to_json(self) -> str:
        """The report as JSON text."""
        return json.dumps(self, indent=2, sort_keys=True)

    def save(self, path: str) -> None:
        """Writes the JSON atomically: a reader never sees a half-written file."""
        write_json_atomic(path, self, sort_keys=True)
