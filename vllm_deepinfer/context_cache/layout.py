"""What a persisted block's bytes depend on, hashed into the directory the blocks live
in and into every block file's header: the plugin's version, the checkpoint (its path,
config and weight files), the cache precision and byte sizes, the block size and the
cached groups' layers. Another model, precision, block size or plugin version finds
nothing (a miss), never bytes it would misread.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata

from vllm.v1.kv_offload.config import OffloadingConfig

from vllm_deepinfer.context_cache.block_file import FORMAT_VERSION

LAYOUT_FILE = "layout.json"
NAMESPACE_PREFIX = "deepinfer-"


def plugin_version() -> str:
    try:
        return metadata.version("vllm-deepinfer")
    except metadata.PackageNotFoundError:
        return "unknown"


def checkpoint_fingerprint(model: str) -> str:
    """The checkpoint's config and weight files (names and sizes); the path alone for a
    model that is not a local directory."""
    if not os.path.isdir(model):
        return model
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name == "config.json":
            with open(path, "rb") as f:
                digest.update(f.read())
        elif name.endswith((".safetensors", ".bin", ".pt")):
            digest.update(f"{name}:{os.path.getsize(path)};".encode())
    return digest.hexdigest()


def layout_fields(config: OffloadingConfig, payload_bytes: int) -> dict:
    return {
        "plugin_version": plugin_version(),
        "block_file_format": FORMAT_VERSION,
        "model": config.model.name,
        "checkpoint": checkpoint_fingerprint(config.model.name),
        "cache_dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [
            {"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)}
            for g in config.groups
        ],
        "bytes_per_block": config.worker_kv_bytes_per_block,
        "payload_bytes": payload_bytes,
        "world_size": config.parallel.world_size,
    }


def layout_digest(fields: dict) -> bytes:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()[:16]


def other_layouts(root: str, fields: dict) -> list[str]:
    """What differs from `fields` in each other layout kept under `root` for the same
    model, e.g. ['plugin_version 0.1.0 -> 0.2.0']."""
    differences: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return differences
    for name in sorted(names):
        try:
            with open(os.path.join(root, name, LAYOUT_FILE)) as f:
                other = json.load(f)
        except (OSError, ValueError):
            continue
        if other.get("model") != fields["model"] or other == fields:
            continue
        changed = [
            f"{key} {other.get(key)!r} -> {value!r}"
            for key, value in fields.items()
            if key != "groups" and other.get(key) != value
        ]
        if other.get("groups") != fields["groups"]:
            changed.append("cached groups")
        differences.append(f"{name}: {', '.join(changed)}")
    return differences
