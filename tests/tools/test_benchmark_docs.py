"""benchmarks/ holds results that its documents cite: every path README.md,
BUILD.md, docs/*.md and the benchmark documents name exists (a
removed file is cited only as git history, on a line naming the commit
that has it), every in-page link has its heading, every file kept is cited
by its folder's README or RESULTS.md, and the folder stays small: at most
150 files, none loose beside RESULTS.md, each README within 150 lines."""
import fnmatch
import glob
import os
import re

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")
# Hand-written documents (the runs' generated report.md files are raw data).
DOCS = (["README.md", "BUILD.md", "benchmarks/RESULTS.md"] +
        sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(
            os.path.join(REPO_ROOT, "docs", "*.md"))) +
        sorted(os.path.relpath(p, REPO_ROOT) for p in glob.glob(
            os.path.join(BENCHMARKS, "**", "README.md"), recursive=True)))
# Where removed files are cited from (git history).
HISTORY_COMMITS = ("d8888bb", "6672e66")
MAX_FILES = 150
MAX_README_LINES = 150
PATH_SUFFIXES = (".json", ".log", ".txt", ".png", ".md", ".tgz", ".py",
                 ".sh", ".jsonl")


def _text(doc):
  text = open(os.path.join(REPO_ROOT, doc)).read()
  # What RESULTS.md lists as removed is, by definition, not here.
  return text.split("\n## Removed from this folder")[0]


def _cited_paths(doc):
  """(line number, path as written) of what `doc` names as a file or
  folder: markdown link targets, backticked paths, and in README.md and
  BUILD.md every benchmarks/ path."""
  for number, line in enumerate(_text(doc).splitlines(), 1):
    if any(commit in line for commit in HISTORY_COMMITS):
      continue
    tokens = re.findall(r"\]\(([^)#\s]+)[^)]*\)", line)
    tokens += [t for t in re.findall(r"`([^`\s]+)`", line)
               if "/" in t or t.endswith(PATH_SUFFIXES)]
    if not doc.startswith("benchmarks/"):
      tokens += re.findall(r"benchmarks/[A-Za-z0-9_./*-]*", line)
    for token in tokens:
      token = token.rstrip(".,:;")
      if (token.startswith(("http", "--", "$", "/", "~")) or "<" in token
          or "..." in token or "NN" in token or "=" in token
          or token.startswith(("OUT", "DIR"))):
        continue
      yield number, token


ROOTS = ("benchmarks/", "../", "tools/", "scripts/", "tests/", "host/",
         "plugin/", "model_configs/")
# RESULTS.md names the folders beside it (in a sub-folder's README,
# `maxtext/...` is MaxText's own source).
SUBFOLDERS = tuple(f"{d}/" for d in os.listdir(BENCHMARKS)
                   if os.path.isdir(os.path.join(BENCHMARKS, d)))


def _checked(doc, token):
  """A path this test can resolve: one from the repository's top (or,
  in RESULTS.md, from benchmarks/)."""
  if not doc.startswith("benchmarks/"):
    return token.startswith("benchmarks/")
  roots = ROOTS + (SUBFOLDERS if doc == "benchmarks/RESULTS.md" else ())
  return token.startswith(roots)


def _exists(doc, token):
  bases = [os.path.dirname(os.path.join(REPO_ROOT, doc)), REPO_ROOT,
           BENCHMARKS]
  for base in bases:
    path = os.path.normpath(os.path.join(base, token))
    if glob.glob(path) if "*" in token else os.path.exists(path):
      return True
  return False


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_path_exists(doc):
  cited = [(number, token) for number, token in _cited_paths(doc)
           if _checked(doc, token)]
  missing = [f"{doc}:{number}: {token}" for number, token in cited
             if not _exists(doc, token)]
  assert not missing, "\n".join(missing)
  if doc in ("docs/ADVANCED.md", "benchmarks/RESULTS.md"):
    assert len(cited) > 5, cited  # The pattern still finds the citations.


def _slug(heading):
  """GitHub's anchor of a heading."""
  slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return slug.replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS)
def test_every_in_page_link_has_its_heading(doc):
  text = open(os.path.join(REPO_ROOT, doc)).read()
  anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
  links = re.findall(r"\]\(#([^)]+)\)", text)
  assert not [x for x in links if x not in anchors], links


def test_results_names_the_sections_others_cite():
  text = open(os.path.join(BENCHMARKS, "RESULTS.md")).read()
  headings = re.findall(r"^## (.*)$", text, re.M)
  for needed in ("What is not re-checked since the wgmma-wait fix "
                 "(de65204)",
                 "Method", "Machine and versions", "Commands", "The claims",
                 "Rings on one GPU (virtual ranks, two processes)"):
    assert needed in headings, needed


def _files():
  """Every file under benchmarks/, relative to it."""
  return sorted(os.path.relpath(p, BENCHMARKS)
                for p in glob.glob(os.path.join(BENCHMARKS, "**", "*"),
                                   recursive=True) if os.path.isfile(p))


def test_benchmarks_is_small_with_nothing_loose_at_its_top():
  files = _files()
  assert len(files) <= MAX_FILES, len(files)
  assert [f for f in files if os.sep not in f] == ["RESULTS.md"]


def test_every_folder_has_a_readme_within_its_length():
  for folder in SUBFOLDERS:
    readme = os.path.join(BENCHMARKS, folder, "README.md")
    assert os.path.isfile(readme), folder
    with open(readme) as f:
      assert len(f.read().splitlines()) <= MAX_README_LINES, folder


def _stem(path):
  return path.rstrip("/").rsplit(".", 1)[0] if "." in os.path.basename(
      path.rstrip("/")) else path.rstrip("/")


def test_every_file_is_cited_by_its_folders_readme_or_results():
  """What no document names is a notebook leftover: cite it or remove it.
  A file counts as cited by name, by a pattern (`small_*.json`), by its
  stem with another extension (`run.json` and its `run.log`), or by its
  sub-folder (`llama2-grouped/`)."""
  results = open(os.path.join(BENCHMARKS, "RESULTS.md")).read()
  uncited = []
  for path in _files():
    folder, _, inner = path.partition(os.sep)
    if not inner or inner == "README.md":
      continue
    text = open(os.path.join(BENCHMARKS, folder, "README.md")).read()
    tokens = re.findall(r"`([^`\s]+)`", text) + re.findall(
        r"\]\(([^)#\s]+)", text)
    tokens += [t[len(folder) + 1:] for t in
               re.findall(r"`([^`\s]+)`", results) + re.findall(
                   r"\]\(([^)#\s]+)", results)
               if t.startswith(folder + "/")]
    if not any(fnmatch.fnmatch(inner, token)
               or fnmatch.fnmatch(_stem(inner), _stem(token))
               or (token.endswith("/") and inner.startswith(token))
               for token in tokens):
      uncited.append(path)
  assert not uncited, uncited


def test_no_notebook_leftovers():
  """No command scripts, experiment diffs or one-off scripts among the
  results."""
  leftovers = [p for p in glob.glob(os.path.join(BENCHMARKS, "**", "*"),
                                    recursive=True)
               if p.endswith(("_command.sh", ".diff", ".py", ".sh"))]
  assert not leftovers, leftovers
