"""The rule-based sentence splitter on hand-written cases (expected splits written by hand)."""
import pytest

from bertctl.data.sentences import split_paragraphs, split_sentences

CASES = [
    # plain full stops, question and exclamation marks
    ("The cat sat. The dog ran! Did it? Yes.", ["The cat sat.", "The dog ran!", "Did it?", "Yes."]),
    # titles never end a sentence
    ("Mr. Smith met Dr. Jones and Mrs. Brown. They talked.",
     ["Mr. Smith met Dr. Jones and Mrs. Brown.", "They talked."]),
    ("Prof. Lee and St. Paul were there. Gen. Grant too.", ["Prof. Lee and St. Paul were there.", "Gen. Grant too."]),
    # decimals, money and version numbers have no space after the dot
    ("Pi is 3.14 or so. It cost $2.50 today. Version 1.2.3 shipped.",
     ["Pi is 3.14 or so.", "It cost $2.50 today.", "Version 1.2.3 shipped."]),
    # initials
    ("Harry S. Truman spoke. J. R. R. Tolkien wrote.", ["Harry S. Truman spoke.", "J. R. R. Tolkien wrote."]),
    # upper-case initialisms stay inside the sentence; e.g. / i.e. never end one
    ("The U.S. Congress met. Fruit, e.g. Apples and pears, i.e. Pome fruit. Done.",
     ["The U.S. Congress met.", "Fruit, e.g. Apples and pears, i.e. Pome fruit.", "Done."]),
    # lower-case initialisms split before a capital
    ("We met at 5 p.m. The talk began.", ["We met at 5 p.m.", "The talk began."]),
    # No. before a digit is an abbreviation, "no." elsewhere ends a sentence
    ("See No. 5 and Fig. 3 here. He said no. Then he left.",
     ["See No. 5 and Fig. 3 here.", "He said no.", "Then he left."]),
    # ellipses: a split before a capital, none before lower case
    ("I wonder... Then it ended. He paused... then went on.",
     ["I wonder...", "Then it ended.", "He paused... then went on."]),
    ("Wait\u2026 What now?", ["Wait\u2026", "What now?"]),
    # closing quotes and brackets stay with their sentence
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("It was odd (see above.) Next came rain.", ["It was odd (see above.)", "Next came rain."]),
    ("\u201cReally?\u201d she asked. \u201cYes!\u201d", ["\u201cReally?\u201d she asked.", "\u201cYes!\u201d"]),
    # a sentence opening with a quote or a bracket
    ('It ended. "Go home," he said. (Nobody did.)', ["It ended.", '"Go home," he said.', "(Nobody did.)"]),
    # lower case after the stop: not a boundary
    ("The value was approx. ten. Next.", ["The value was approx. ten.", "Next."]),
    # digits start sentences too
    ("The war ended in 1945. 1946 was calm.", ["The war ended in 1945.", "1946 was calm."]),
    # repeated terminal punctuation
    ("What?! No way!! Fine.", ["What?!", "No way!!", "Fine."]),
    # nothing to split
    ("no terminal punctuation here", ["no terminal punctuation here"]),
    ("   ", []),
]


@pytest.mark.parametrize("text,expected", CASES, ids=[c[0][:30] for c in CASES])
def test_split_sentences(text, expected):
    assert split_sentences(text) == expected


def test_split_paragraphs_joins_wrapped_lines():
    lines = ["It is a truth universally", "acknowledged.", "", "", "  Second   ", "paragraph.", ""]
    assert split_paragraphs(lines) == ["It is a truth universally acknowledged.", "Second paragraph."]


def test_sentences_cover_the_text():
    """Splitting loses nothing but the white space between sentences."""
    text = "Mr. A. B. Smith, Jr. arrived at 3.30 p.m. He left... Then? \"Yes.\" (Fine.) The U.S. Army won."
    assert "".join(split_sentences(text)).replace(" ", "") == text.replace(" ", "")
