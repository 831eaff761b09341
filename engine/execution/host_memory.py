"""The memory this process can still take, and the refusal of a model that cannot fit in it.

Why up front: a GGUF file larger than memory loads for minutes and is then ended by the OOM
killer with no message (or, under a cgroup limit, the container restarts in a loop). Its size is
known before a byte of it is read, so a start that cannot fit says so at once, naming the sizes.

Available memory is the smaller of
- MemAvailable from /proc/meminfo (free memory plus what the kernel reclaims without swapping:
  clean page cache, the file's own cached pages included), and
- for the memory cgroup this process is in and each ancestor with a limit, limit - usage + its
  inactive file pages (what the kernel reclaims there before its OOM killer acts), cgroup v2
  (memory.max, memory.current, memory.stat's inactive_file) or v1 (memory.limit_in_bytes,
  memory.usage_in_bytes, memory.stat's total_inactive_file; a limit near 2^63 is none).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as the largest page multiple below 2^63
GIB = 2**30


@dataclass(frozen=True, slots=True)
class HostMemory:
    available_bytes: int
    source: str  # what bounds it: "MemAvailable" or "the memory cgroup <path>'s limit"

    @classmethod
    def read(cls, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory | None:
        """What this process can take now; None where neither /proc/meminfo nor a cgroup limit
        can be read (not Linux): then nothing is refused."""
        best: HostMemory | None = None
        available = _meminfo_available(proc / "meminfo")
        if available is not None:
            best = cls(available, "MemAvailable")
        for directory in _cgroup_dirs(proc / "self" / "cgroup", cgroup_root):
            room = _cgroup_room(directory)
            if room is not None and (best is None or room < best.available_bytes):
                best = cls(room, f"the memory cgroup {directory}'s limit")
        return best

    def check_fits(self, what: str, weight_bytes: int, kv_cache_bytes: int) -> None:
        """Raise ValueError (naming the field `model`) when weights and KV pool exceed what is available."""
        needed = weight_bytes + kv_cache_bytes
        if needed > self.available_bytes:
            raise ValueError(
                f"model: {what} needs {needed / GIB:.2f} GiB resident (its weights {weight_bytes / GIB:.2f} GiB + the "
                f"KV pool {kv_cache_bytes / GIB:.2f} GiB), more than the {self.available_bytes / GIB:.2f} GiB "
                f"available ({self.source}); use a smaller file, or a smaller KV pool (kv_cache_gib, num_kv_blocks)")


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_dirs(self_cgroup: Path, root: Path) -> list[Path]:
    """The memory cgroup's directory and its ancestors up to the mount (v2: root itself; v1:
    root/memory). A path not under the mount (a cgroup namespace shows "/") falls back to it."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and (root / "cgroup.controllers").exists():
            mount = root
        elif "memory" in controllers.split(","):
            mount = root / "memory"
        else:
            continue
        directory = mount / path.lstrip("/")
        if not directory.is_dir():
            directory = mount
        dirs = [directory]
        while dirs[-1] != mount and mount in dirs[-1].parents:
            dirs.append(dirs[-1].parent)
        return dirs
    return []


def _cgroup_room(directory: Path) -> int | None:
    """limit - usage + inactive file pages of one cgroup directory; None without a limit."""
    v2 = (directory / "memory.max").exists()
    names = ("memory.max", "memory.current", "inactive_file") if v2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    try:
        limit_text = (directory / names[0]).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _UNLIMITED:
            return None
        usage = int((directory / names[1]).read_text())
        stat = dict(line.split()[:2] for line in (directory / "memory.stat").read_text().splitlines() if " " in line)
        inactive = int(stat.get(names[2], 0))
    except (OSError, ValueError):
        return None
    return max(0, int(limit_text) - usage + inactive)
