"""Re-creates the vendored schema samples from git checkouts of their sources (see
README.md): `python data/schemas/vendor.py SOURCE GIT_DIR`. The selection is fixed by
rule, so a rerun at the same commit gives the same files."""
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
MAX_BYTES = 16_000  # keeps the data small; larger schemas are mostly generated configs
PER_SOURCE = 200


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], check=True,
                          capture_output=True, text=True).stdout


def small_files(repo: str, folder: str) -> list[str]:
    """Paths under folder at HEAD of at most MAX_BYTES (objects the snapshot lacks left out)."""
    listing = (line.split("\t") for line in
               git(repo, "ls-tree", "-r", "-l", "HEAD", folder).splitlines())
    return sorted(path for meta, path in listing
                  if meta.split()[3].isdigit() and int(meta.split()[3]) <= MAX_BYTES)


def iglu_central(repo: str) -> dict[str, str]:
    """The newest version of every event schema (schemas/VENDOR/NAME/jsonschema/X-Y-Z)."""
    newest: dict[tuple, tuple] = {}
    for path in small_files(repo, "schemas"):
        parts = path.split("/")
        if len(parts) != 5:
            continue
        version = tuple(int(n) for n in parts[4].split("-"))
        key = (parts[1], parts[2])
        if key not in newest or version > newest[key][0]:
            newest[key] = (version, path)
    paths = sorted(path for _, path in newest.values())
    return {"{}.{}.json".format(*p.split("/")[1:3]): p for p in _spread(paths)}


def schemastore(repo: str) -> dict[str, str]:
    """Catalogue schemas of src/schemas/json under MAX_BYTES."""
    paths = [p for p in small_files(repo, "src/schemas/json") if p.endswith(".json")]
    return {Path(p).name: p for p in _spread(paths)}


def _spread(paths: list[str]) -> list[str]:
    """PER_SOURCE paths evenly spread over the sorted list (not just the first letters)."""
    step = max(1, len(paths) / PER_SOURCE)
    return [paths[int(i * step)] for i in range(min(PER_SOURCE, len(paths)))]


SOURCES = {"iglu-central": iglu_central, "schemastore": schemastore}

if __name__ == "__main__":
    source, repo = sys.argv[1], sys.argv[2]
    out = HERE / source
    out.mkdir(exist_ok=True)
    for name, path in SOURCES[source](repo).items():
        text = git(repo, "show", f"HEAD:{path}")
        try:
            json.loads(text)
        except json.JSONDecodeError:
            continue  # a few catalogue files are JSON with comments
        (out / name).write_text(text)
    print(source, git(repo, "rev-parse", "HEAD").strip(), len(list(out.glob("*.json"))))
