"""README.md is a front door that cannot drift: every ```python block in it runs as written, its results tables
are what benchmarks/readme_tables.py makes of the committed data, and it stays short (at most 2,500 words of
prose, no paragraph over 150 words, no commit hashes). The test command it shows is the one CI runs."""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import readme_tables  # noqa: E402

MAX_PROSE_WORDS = 2500
MAX_PARAGRAPH_WORDS = 150
# a block that calls <key> claims to print <value> (the comments and text around it say so); a claim of equal bits
# makes its block's case a `bitwise` test, named after the call (tests/isa.py LEG_REPEATS names it)
CLAIMS = {"ja.mismatch_metrics": "k3: 0.0\n", "ja.compare": "k3 "}
BITWISE_CLAIMS = ("ja.mismatch_metrics",)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python blocks, in order."""
    return [body for lang, body in FENCE.findall(text) if lang == "python"]


def prose_paragraphs(text: str) -> list[str]:
    """The README's prose: code blocks, tables (lines starting with '|') and HTML comments left out; a paragraph
    is a run of lines between blank lines, and each list item is a paragraph of its own."""
    text = HTML_COMMENT.sub("", FENCE.sub("", text))
    paragraphs, current = [], []
    for line in text.splitlines() + [""]:
        stripped = line.strip()
        starts_item = re.match(r"^(- |\d+\. )", stripped) is not None
        if not stripped or stripped.startswith("|") or starts_item:
            if current:
                paragraphs.append(" ".join(current))
            current = [stripped] if starts_item else []
        else:
            current.append(stripped)
    return paragraphs


def _words(paragraph: str) -> int:
    return len(re.findall(r"\S+", paragraph))


def test_prose_counter_leaves_out_code_and_tables_and_splits_list_items():
    text = ("# Title\n\nOne two three.\nFour.\n\n```python\nx = 1 + 2  # many words in code\n```\n\n"
            "| a | b |\n|---|---|\n| c | d |\n\n- item one\n- item two words\n<!-- a comment -->\n")
    assert prose_paragraphs(text) == ["# Title", "One two three. Four.", "- item one", "- item two words"]
    assert sum(_words(p) for p in prose_paragraphs(text)) == 2 + 4 + 3 + 4


def test_readme_is_short_and_its_paragraphs_are_short():
    paragraphs = prose_paragraphs(_readme())
    words = sum(_words(p) for p in paragraphs)
    longest = max(paragraphs, key=_words)
    assert words <= MAX_PROSE_WORDS, f"README has {words} words of prose; at most {MAX_PROSE_WORDS}"
    assert _words(longest) <= MAX_PARAGRAPH_WORDS, f"{_words(longest)} words: {longest[:200]}..."


def test_readme_names_no_commit_hash():
    hashes = re.findall(r"\b[0-9a-f]{7,40}\b", _readme())
    assert not hashes, f"commit hashes (or hash-like strings) in README.md: {hashes}"


def test_readme_tables_are_generated_from_the_committed_data():
    text = _readme()
    names = readme_tables.MARKER.findall(text)
    assert sorted(names) == sorted(readme_tables.RENDERERS), names
    assert readme_tables.render(text) == text, "run python benchmarks/readme_tables.py"


def test_a_changed_result_changes_the_readme_table(tmp_path):
    """The check above can fail: the same README rendered from data with one figure changed differs there."""
    import json
    import shutil
    for source in readme_tables.SOURCES.values():
        os.makedirs(tmp_path / os.path.dirname(source), exist_ok=True)
        shutil.copy(os.path.join(ROOT, source), tmp_path / source)
    study = tmp_path / readme_tables.SOURCES["study"]
    record = json.loads(study.read_text())
    record["rows"][0]["final_reward"] = 0.123456
    study.write_text(json.dumps(record))
    text = _readme()
    changed = readme_tables.render(text, root=str(tmp_path))
    assert changed != text and "-> 0.123 ± " in changed


def test_readme_test_command_is_the_one_ci_runs():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    command = 'pip install -e ".[test,hf]" && jaxalign vllm install && python -m pytest -q'
    assert command in ci
    assert f"```bash\n{command}\n```" in _readme()


def test_readme_has_python_blocks():
    assert len(python_blocks(_readme())) >= 2


def _block_cases() -> list:
    """One case per python block, named after the first call it makes a claim about (else its position)."""
    cases = []
    for index, code in enumerate(python_blocks(_readme())):
        claims = [key for key in CLAIMS if key in code]
        name = claims[0].split(".")[-1] if claims else f"block{index}"
        marks = [pytest.mark.bitwise] if any(key in code for key in BITWISE_CLAIMS) else []
        cases.append(pytest.param(index, id=name, marks=marks))
    return cases


@pytest.mark.parametrize("index", _block_cases())
def test_readme_python_block_runs_as_written(index, tmp_path, monkeypatch, capsys):
    """Each block in a fresh namespace, in an empty working directory, as a user would paste it."""
    monkeypatch.chdir(tmp_path)
    code = python_blocks(_readme())[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert out.strip(), "a README block should print what it shows"
    for marker, shown in CLAIMS.items():  # what the README says a block prints
        if marker in code:
            assert shown in out, f"README block {index} should print {shown!r}; it printed {out!r}"


def test_links_in_readme_and_docs_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists."""
    import glob
    broken = []
    for page in ["README.md", *sorted(glob.glob(os.path.join("docs", "*.md"), root_dir=ROOT))]:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not target.startswith(("http://", "https://", "mailto:")) and not os.path.exists(
                    os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))):
                broken.append(f"{page}: {target}")
    assert not broken, broken
