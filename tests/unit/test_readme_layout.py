"""README's layout table against the tree: every package and module listed, none that is gone.

The table is made from the tree: each row is a path and its one job, the first sentence
of the module's docstring (a C file's header comment, a Go package's doc comment). Modules
move and split; when this test fails it prints the rows to add and the rows to drop, and

    .venv/bin/python tests/unit/test_readme_layout.py --print

prints the whole table afresh for README's "Layout" section. Only the set of paths is
held to the tree (a row's wording and order are the editor's). Also: every flag
`kvprefetchd --help` offers is named in README's "Running it" section.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DAEMON = "daemon/kvprefetchd"
# The daemon's packages in the order a request meets them, then the rest.
PATH_ORDER = ("listeners", "ops", "supervisor", "channel.py", "worker", "engines", "roots",
              "metrics", "kv")
LAYOUT_HEADING = "## Layout"
FLAGS_HEADING = "## Running it"


# ---- what the tree holds ----------------------------------------------------------------------


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line, table-safe."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.?!])\s+(?=[A-Z`(])", paragraph, maxsplit=1)[0]
    return sentence.rstrip(".").replace("|", "\\|")


def python_job(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return first_sentence(docstring) if docstring else "(no docstring)"


def c_job(path: Path) -> str:
    """From the header comment: `/*\\n * name.c: what it is.` without the name."""
    match = re.match(r"\s*/\*(.*?)\*/", path.read_text(encoding="utf-8"), re.S)
    if not match:
        return "(no header comment)"
    text = "\n".join(line.strip().lstrip("*").strip() for line in match.group(1).splitlines())
    return first_sentence(re.sub(rf"^\s*{re.escape(path.name)}:\s*", "", text))


def go_job(directory: Path) -> str:
    """From the package's doc comment (`// Package x ...` or `// Command x ...`)."""
    for source in sorted(directory.glob("*.go")):
        if source.name.endswith("_test.go"):
            continue
        lines = source.read_text(encoding="utf-8").splitlines()
        if lines and re.match(r"// (Package|Command) ", lines[0]):
            comment = []
            for line in lines:
                if not line.startswith("//"):
                    break
                comment.append(line[2:].strip())
            return first_sentence("\n".join(comment))
    return "(no package comment)"


def _order(relative: str) -> tuple[int, str]:
    head = relative.split("/")[0]
    rank = PATH_ORDER.index(head) if head in PATH_ORDER else len(PATH_ORDER) + (
        0 if relative.endswith("/") or "/" in relative else 1)
    return rank, relative


def daemon_rows() -> list[tuple[str, str]]:
    base = ROOT / DAEMON
    rows = [(f"{DAEMON}/", python_job(base / "__init__.py"))]
    entries: list[tuple[str, str]] = []
    for path in base.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        relative = path.relative_to(base).as_posix()
        if path.name == "__init__.py":
            if path.parent != base:
                entries.append((relative.removesuffix("__init__.py"), python_job(path)))
        else:
            entries.append((relative, python_job(path)))
    entries.sort(key=lambda entry: _order(entry[0]))
    rows += [(f"{DAEMON}/{relative}", job) for relative, job in entries]
    return rows


def native_rows() -> list[tuple[str, str]]:
    base = ROOT / "native"
    rows = [(f"native/{p.name}", c_job(p))
            for p in sorted([*base.glob("*.c"), *base.glob("*.h")])]
    build = base / "build_native.py"
    if build.exists():
        rows.append(("native/build_native.py", python_job(build)))
    return rows


def client_rows() -> list[tuple[str, str]]:
    package = ROOT / "clients/python/kvprefetch"
    rows = [("clients/python/kvprefetch/", python_job(package / "__init__.py"))]
    rows += [(f"clients/python/kvprefetch/{p.name}", python_job(p))
             for p in sorted(package.glob("*.py")) if p.name != "__init__.py"]
    go = ROOT / "clients/go"
    directories = sorted({p.parent for p in go.rglob("*.go") if not p.name.endswith("_test.go")})
    for directory in directories:
        relative = directory.relative_to(ROOT).as_posix()
        rows.append((f"{relative}/", go_job(directory)))
    return rows


def tree_rows() -> list[tuple[str, str]]:
    """Every row the layout table must have, in the order `--print` gives them."""
    return daemon_rows() + native_rows() + client_rows()


def table(rows: list[tuple[str, str]]) -> str:
    lines = ["| path | its one job |", "|---|---|"]
    lines += [f"| `{path}` | {job} |" for path, job in rows]
    return "\n".join(lines)


# ---- what README says ---------------------------------------------------------------------------


def section(heading: str) -> str:
    """README's section under `heading`, up to the next heading of the same level."""
    text = README.read_text(encoding="utf-8")
    start = text.find("\n" + heading + "\n")
    assert start >= 0, f"README.md has no {heading!r} section"
    level = heading.split()[0]
    end = text.find(f"\n{level} ", start + len(heading) + 2)
    return text[start: end if end >= 0 else len(text)]


LISTED = re.compile(r"^\|\s*`((?:daemon/kvprefetchd|native|clients)/[^`]*)`\s*\|", re.M)


def listed_paths() -> list[str]:
    return LISTED.findall(section(LAYOUT_HEADING))


# ---- the tests ---------------------------------------------------------------------------------


def test_every_module_is_in_readmes_layout_and_nothing_gone_is() -> None:
    rows = tree_rows()
    wanted = {path for path, _ in rows}
    listed = listed_paths()
    missing = [(path, job) for path, job in rows if path not in listed]
    gone = [path for path in listed if path not in wanted]
    twice = sorted({path for path in listed if listed.count(path) > 1})
    message = []
    if missing:
        message.append("README.md's Layout lacks these rows (add them; or regenerate the "
                       "table: python tests/unit/test_readme_layout.py --print):\n"
                       + "\n".join(f"| `{path}` | {job} |" for path, job in missing))
    if gone:
        message.append("README.md's Layout lists paths that are gone (drop them):\n"
                       + "\n".join(gone))
    if twice:
        message.append("README.md's Layout lists these twice:\n" + "\n".join(twice))
    assert not message, "\n\n".join(message)


def test_the_tree_gives_every_row_a_job() -> None:
    """A module without a docstring would leave its row empty: the table says why each is."""
    empty = [path for path, job in tree_rows() if job.startswith("(no ")]
    assert not empty, f"no docstring or header comment to take a row's job from: {empty}"


def test_readme_names_every_daemon_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "kvprefetchd", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"kvprefetchd --help failed: {result.stderr[-2000:]}"
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", result.stdout)) - {"--help"}
    assert flags, result.stdout
    running = section(FLAGS_HEADING)
    unnamed = sorted(flag for flag in flags
                     if not re.search(rf"`{re.escape(flag)}(?![a-z0-9-])", running))
    assert not unnamed, f"README.md's 'Running it' does not name these flags: {unnamed}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--print"]:
        print(table(tree_rows()))
    else:
        print("usage: python tests/unit/test_readme_layout.py --print", file=sys.stderr)
        sys.exit(2)
