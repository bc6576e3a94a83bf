"""The measured-bandwidth profile `strategy="auto"` decides from: a versioned JSON file in the user cache directory,
written atomically by `moe-engine bench --profile`.

Fields (GB/s unless named): cpu_read (the CPU's read ceiling), executor[format] (the executor's weight bytes / time
at the model's shape), h2d (pinned host-to-device copy), zero_copy[format] (GPU experts reading weights from pinned
host memory), both[format] = {"cpu", "zero_copy"} (the two running at once), cpu_fixed_us / gpu_fixed_us (a step's
cost with no expert bytes: handshake and launches), hbm (the GPU experts' read rate of resident weights); gpu (the
device name it was measured on), shape {E, H, I, top_k}, version, created.

A profile found in the cache that is stale (another version) or from another GPU is ignored with a warning naming
the command to rerun; one passed explicitly is refused with a ValueError saying the same.

Thread contract: plain functions and an immutable value; save() is atomic (write to a temporary file in the same
directory, then rename), so concurrent writers leave one whole profile."""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

log = logging.getLogger("moe_engine")
VERSION = 2  # 2: the GPU parts measured under CUDA graphs, HBM and zero-copy net of the fixed cost
RERUN = "moe-engine bench --profile"


class ProfileError(ValueError):
    """A profile that does not fit this machine, format or version."""


@dataclass(frozen=True)
class Profile:
    gpu: str
    cpu_read: float
    executor: dict  # format -> GB/s
    h2d: float = 0.0
    zero_copy: dict = field(default_factory=dict)  # format -> GB/s
    both: dict = field(default_factory=dict)  # format -> {"cpu": GB/s, "zero_copy": GB/s}
    cpu_fixed_us: float = 0.0
    gpu_fixed_us: float = 0.0
    hbm: float = 0.0
    shape: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)  # format -> why a part was not measured
    version: int = VERSION
    created: float = 0.0

    def __post_init__(self):
        for name in ("cpu_read", "h2d", "cpu_fixed_us", "gpu_fixed_us", "hbm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ProfileError(f"profile field {name}={v!r}: expected a number >= 0")
        for name in ("executor", "zero_copy"):
            d = getattr(self, name)
            if not isinstance(d, dict) or any(not isinstance(v, (int, float)) or not v > 0 for v in d.values()):
                raise ProfileError(f"profile field {name}={d!r}: expected {{format: GB/s > 0}}")

    def check(self, *, gpu: str | None, format: str) -> None:
        """Raise ProfileError unless this profile was measured at this version, on `gpu` and for `format`."""
        if self.version != VERSION:
            raise ProfileError(f"profile version {self.version}, expected {VERSION}; rerun `{RERUN}`")
        if gpu is not None and self.gpu != gpu:
            raise ProfileError(f"profile measured on GPU {self.gpu!r}, this is {gpu!r}; rerun `{RERUN}` here")
        if format not in self.executor:
            raise ProfileError(f"profile has no executor figure for format {format!r} (it has "
                               f"{sorted(self.executor)}); rerun `{RERUN} --format {format}`")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        if not isinstance(d, dict):
            raise ProfileError(f"profile: expected a JSON object, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        missing = {"gpu", "cpu_read", "executor"} - set(d)
        if missing:
            raise ProfileError(f"profile lacks {sorted(missing)}; rerun `{RERUN}`")
        return cls(**{k: v for k, v in d.items() if k in known})


def cache_dir() -> str:
    """$XDG_CACHE_HOME/moe-engine, else ~/.cache/moe-engine (the XDG default; platformdirs' rule on Linux)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moe-engine")


def _slug(gpu: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-") or "none"


def default_path(gpu: str) -> str:
    return os.path.join(cache_dir(), f"profile-{_slug(gpu)}.json")


def save(profile: Profile, path: str | None = None) -> str:
    """Write atomically; returns the path."""
    path = path or default_path(profile.gpu)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    d = profile.to_json()
    d["created"] = d["created"] or time.time()
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(d, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path: str) -> Profile:
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ProfileError(f"profile {path}: not JSON ({e}); rerun `{RERUN}`") from None
    try:
        return Profile.from_json(d)
    except (ProfileError, TypeError) as e:
        raise ProfileError(f"profile {path}: {e}") from None


def find(gpu: str, format: str) -> Profile | None:
    """This GPU's cached profile, or None (with a warning naming what to rerun) when it is missing a format, stale,
    from another GPU or unreadable."""
    path = default_path(gpu)
    if not os.path.exists(path):
        return None
    try:
        p = load(path)
        p.check(gpu=gpu, format=format)
    except (ProfileError, OSError) as e:
        log.warning("ignoring the cached profile %s: %s", path, e)
        return None
    return p


def resolve(profile, *, gpu: str | None, format: str) -> Profile | None:
    """The profile `strategy="auto"` uses: an explicit one (a Profile, a dict or a path; refused with ProfileError
    when it does not fit), else the cached one for `gpu` (ignored with a warning when it does not fit), else None."""
    if profile is None:
        return find(gpu, format) if gpu is not None else None
    if isinstance(profile, (str, os.PathLike)):
        p = load(os.fspath(profile))
    elif isinstance(profile, dict):
        p = Profile.from_json(profile)
    elif isinstance(profile, Profile):
        p = profile
    else:
        raise TypeError(f"profile={type(profile).__name__}: expected a Profile, a dict or a path to a profile JSON")
    p.check(gpu=gpu, format=format)
    return p
