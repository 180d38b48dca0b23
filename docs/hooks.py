"""mkdocs hooks: what the site generates from the code and the repository when it is built.

- the home page is the repository's README.md, its links rewritten for the site;
- the pictures that the README and the pages show from benchmarks/results/ are copied
  into the site as img/NAME (the pages link them as ../benchmarks/results/NAME, which
  works where the Markdown is read as plain files);
- `<!-- env-table -->` is filled with `distcomm.config.env_table()`, the table that
  `python -m distcomm.config` prints (no hand copy to go stale);
- `<!-- reference: distcomm -->` becomes one mkdocstrings entry per public name of
  `distcomm.__all__`, grouped as the api-list of api.md groups them, each resolved at
  build time to the module that defines it, so the pages name public names only and
  internal modules can move without a docs change.

The functions without mkdocs in their signature are pure, so tests import this file
without mkdocs installed.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
PICTURE = re.compile(r"(!\[[^\]]*\]\()(?:\.\./)?benchmarks/results/([\w.-]+\.png)\)")
ENV_TABLE = re.compile(r"<!-- env-table -->\n(?:.*?\n)?<!-- /env-table -->", re.S)
REFERENCE = re.compile(r"^<!-- reference: distcomm -->$", re.M)
API_LIST = re.compile(r"<!-- api-list -->\n(.*?)\n<!-- /api-list -->", re.S)


def readme_as_index(readme: str) -> str:
    """README.md as the site's home page: links into docs/ made relative to the site."""
    text = re.sub(r"\]\(docs/", "](", readme)
    return PICTURE.sub(r"\1img/\2)", text)


def pictures(markdown: str) -> list[str]:
    """The benchmarks/results/*.png files a page shows."""
    return [m.group(2) for m in PICTURE.finditer(markdown)]


def fill_env_table(markdown: str) -> str:
    """The page with its env-table markers holding `python -m distcomm.config`'s output."""
    if not ENV_TABLE.search(markdown):
        return markdown
    from distcomm import config

    table = f"<!-- env-table -->\n{config.env_table()}\n<!-- /env-table -->"
    return ENV_TABLE.sub(lambda _: table, markdown)


def _where(name: str) -> str:
    """The dotted path of the module attribute that `distcomm.NAME` is."""
    import distcomm

    obj = getattr(distcomm, name)
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and qualname and "<" not in qualname:
        owner = sys.modules.get(module) or importlib.import_module(module)
        found = owner
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is obj:
            return f"{module}.{qualname}"
    # a value, not a class or function (default_pg_timeout, reduce_op): the module that
    # distcomm's lazy table imports it from
    homes = getattr(distcomm, "_HOME", {})
    if name in homes:
        return importlib.import_module(homes[name], "distcomm").__name__ + "." + name
    raise LookupError(f"cannot tell which module defines distcomm.{name}")


def reference(api_page: str) -> str:
    """mkdocstrings entries for `distcomm.__all__`, in the groups of the api-list."""
    import distcomm

    listed = API_LIST.search(api_page)
    if not listed:
        raise LookupError("api.md lacks the <!-- api-list --> section")
    public, done, out = set(distcomm.__all__), set(), []
    for item in re.split(r"^- ", listed.group(1), flags=re.M)[1:]:
        title = re.split(r"[:(]", item, maxsplit=1)[0].strip()
        rest = item.partition(":")[2]
        names = [
            n
            for n in dict.fromkeys(re.findall(r"`([A-Za-z_]\w*)", rest))
            if n in public
            and n not in done
            and not isinstance(getattr(distcomm, n), types.ModuleType)
        ]
        if not names:
            continue
        out.append(f"## {title}\n")
        for name in names:
            done.add(name)
            out.append(
                f"::: {_where(name)}\n    options:\n      heading_level: 3\n"
                f"      show_root_full_path: false\n"
            )
    return "\n".join(out)


# -- the mkdocs events --------------------------------------------------------------------------


def on_files(files, config):
    from mkdocs.structure.files import File

    readme = (REPO / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=readme_as_index(readme)))
    shown = set(pictures(readme))
    for page in DOCS.rglob("*.md"):
        shown |= set(pictures(page.read_text()))
    for name in sorted(shown):
        source = REPO / "benchmarks" / "results" / name
        if source.is_file():  # a missing picture stays a broken link: --strict reports it
            files.append(File.generated(config, f"img/{name}", abs_src_path=str(source)))
    return files


def on_page_markdown(markdown, page, config, files):
    markdown = (
        PICTURE.sub(r"\1img/\2)", markdown)
        if page.file.src_uri.count("/") == 0
        else (
            PICTURE.sub(
                lambda m: m.group(1) + "../" * page.file.src_uri.count("/") + f"img/{m.group(2)})",
                markdown,
            )
        )
    )
    markdown = fill_env_table(markdown)
    if REFERENCE.search(markdown):
        entries = reference((DOCS / "api.md").read_text())
        markdown = REFERENCE.sub(lambda _: entries, markdown)
    return markdown
