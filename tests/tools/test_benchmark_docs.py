"""benchmarks/ holds results that its documents cite: every path README.md,
BUILD.md, docs/*.md and the benchmark documents name exists (a
removed file is cited only as git history, on a line naming the commit
that has it), every in-page link has its heading, and every run kept in
kernel_lead/ is listed in its README."""
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
HISTORY_COMMIT = "d8888bb"  # Where the removed files are cited from.
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
    if HISTORY_COMMIT in line:
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
  in RESULTS.md, from benchmarks/), or a kernel run's file."""
  if not doc.startswith("benchmarks/"):
    return token.startswith("benchmarks/")
  roots = ROOTS + (SUBFOLDERS if doc == "benchmarks/RESULTS.md" else ())
  return token.startswith(roots) or re.match(r"run\d+_", token)


def _exists(doc, token):
  bases = [os.path.dirname(os.path.join(REPO_ROOT, doc)), REPO_ROOT,
           BENCHMARKS, os.path.join(BENCHMARKS, "kernel_lead")]
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
                 "Method", "Machine and versions", "Commands",
                 "All-gather kernel, D = 2",
                 "Dedicated senders and chained tiles",
                 "Small problems (D = 2)", "Reduce-scatter kernel, D = 2",
                 "The matmul core on one GPU", "GPU test suite",
                 "End to end: reference host A/B",
                 "End to end: inside MaxText"):
    assert needed in headings, needed


def test_every_kept_kernel_run_is_listed():
  readme = open(os.path.join(BENCHMARKS, "kernel_lead", "README.md")).read()
  listed = set()
  for first, last in re.findall(r"^\| (\d+)(?:-(\d+))?(?:, \d+)* \|", readme,
                                re.M):
    listed.update(range(int(first), int(last or first) + 1))
  for more in re.findall(r"^\| \d+((?:, \d+)+) \|", readme, re.M):
    listed.update(int(x) for x in more.split(",") if x.strip())
  kept = {int(m) for m in re.findall(
      r"^run(\d+)_", "\n".join(os.listdir(os.path.join(BENCHMARKS,
                                                       "kernel_lead"))),
      re.M)}
  assert kept and kept <= listed, sorted(kept - listed)


def test_no_notebook_leftovers():
  """No command scripts, experiment diffs or one-off scripts among the
  results."""
  leftovers = [p for p in glob.glob(os.path.join(BENCHMARKS, "**", "*"),
                                    recursive=True)
               if p.endswith(("_command.sh", ".diff", ".py", ".sh"))]
  assert not leftovers, leftovers
