"""Three GLUE-style tasks built from public-domain prose, for fine-tuning comparisons.

None of them is a human-labelled data set: all are made by rules from sentences of the shared
corpus, so their labels are only as good as the rules. They stand in for MRPC, CoLA and STS-B,
which are not available here, in comparisons where both libraries see the very same data; they are not
a measure of language understanding and their scores must not be compared with GLUE's.

Sentences. Paragraphs of the inaugural addresses, the State of the Union addresses, the prose of
Austen and Chesterton (``corpus/``) and the contexts of the SQuAD v1.1 dev set (Wikipedia), cut
into sentences by a rule (a full stop, question or exclamation mark followed by a space and a
capital letter, except after Mr, Dr, St and the like). Kept: 5 to 40 words, plain ASCII after
mapping typographic quotes and dashes, no double quotes (dialogue), no brackets. A paragraph's
sentences go all to train or all to dev (by a hash of the paragraph), so no dev sentence has a
train sentence from its own paragraph.

paraphrase (MRPC-like: 3,668 train / 408 dev pairs, 2/3 positive; accuracy and F1). Columns
``label  sentence1  sentence2  op``. One side is a corpus sentence (10 to 40 words), the other
a rewrite of it; which side is which is random.
- label 1: one to three meaning-preserving edits: a synonym from a hand-made list, a
  contraction made or undone, a droppable adverb removed (very, really, indeed...), two words
  around "and" swapped, an opening phrase ("In 1990, ...") moved to the end, a number written
  in words or digits, an opening discourse marker (However, Moreover...) dropped.
- label 0: one meaning-changing edit (an antonym from a hand-made list, a negation added or
  removed, a number changed, two capitalised names swapped, a pronoun changed (we/they,
  he/she...), a content word replaced by another word of the corpus), plus zero to two of the
  meaning-preserving edits so that the amount of change alone does not give the label away; or
  (up to a quarter of the negatives) another sentence of the same paragraph that shares at
  least three content words with it, the MRPC-like pairs of different but related sentences.
The synonym and antonym lists are split by word group: a third of the groups make the dev
pairs and the rest the training pairs, so dev asks what the model knows of words it was not
trained on, not whether it memorised the lists. The replacement words come from the split's
own sentences. The rules are blind to context: a "synonym" can be wrong in its sentence and an
"antonym" or a swap of names can leave the meaning unchanged. Those pairs act as label noise,
as the disagreements of human annotators do in MRPC.

acceptability (CoLA-like: 8,551 train / 1,043 dev sentences, 70% acceptable; Matthews
correlation). Columns ``sentence  label  op``. Label 1: a corpus sentence (5 to 25 words) as
written. Label 0: another corpus sentence with one corruption: two adjacent words swapped,
three adjacent words shuffled, a function word dropped, a word doubled, agreement broken
(is/are, was/were, has/have, does/do, this/these, a/an), a pronoun's case changed (we/us,
they/them...), or a verb form broken after a modal or "to" (will goes, to went). Some
corruptions leave a grammatical sentence (a swap of two adjectives, a dropped "that"), and
archaic prose (Austen) reads as odd: the task is noisy on purpose, as CoLA is hard.

similarity (STS-B-like: 5,749 train / 1,500 dev pairs, a score from 0 to 5 in steps of 0.2;
Pearson and Spearman correlation of a regression). Columns ``label  sentence1  sentence2  op``.
Five kinds of pair, each starting from a score: a sentence and its rewrite by one to three of the
paraphrase task's meaning-preserving edits (25%, from 5); one meaning-changing edit (25%, from 3.4)
or two (15%, from 2.2), with up to two preserving edits besides; another sentence of the same
paragraph sharing at least two content words (15%, from 1.0, +0.2 a shared word up to five); a
sentence of another paragraph (20%, from 0, +0.2 a shared word up to two). Each preserving edit
takes 0.3 off, an antonym or negation 0.6 more than other changes; every score then gets Gaussian
noise (std 0.35, the annotators' disagreement), is clipped to [0, 5] and rounded to 0.2.

How hard: MiniLM-L6 scores well above the majority baseline on all three and bertctl and transformers
alike (``benchmarks/results/finetune-{paraphrase,acceptability,similarity}.json``); the paraphrase task
needs its full size to leave always-"1".

Everything follows from the inputs and ``--seed`` (Python's ``random.Random`` and sha256 of
paragraph ids; no dependency on hash seeds, dict order or the platform). The files are written
as TSV with a header (no quoting: the text holds no tabs or double quotes), which
``bertctl finetune glue --train F --dev F --text-column ... --label-column label`` reads.

    python benchmarks/finetune/corpus_tasks.py --corpus ../shared/data/corpus \\
        --squad ../shared/data/squad/dev-v1.1.json --out /tmp/corpus-tasks
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# ------------------------------------------------------------------------------ sentences

# Corpus files used (prose only: the poetry and plays of corpus/gutenberg are left out).
CORPUS_GLOBS = ("inaugural/*.txt", "state_union/*.txt", "gutenberg/austen-*.txt", "gutenberg/chesterton-*.txt")
DEV_PERCENT = 12  # share of paragraphs that go to the dev pools (more than the dev sets need)

_TYPOGRAPHY = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                             "\u2014": " - ", "\u00a0": " "})
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_ABBREV = re.compile(r"\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Gen|Gov|Sen|Rep|Co|Inc|No|vs|Mt|Ft|Lt|Col|Capt|U\.S|U\.N|etc|i\.e|e\.g)\.$")
_ALLOWED = re.compile(r"^[A-Za-z0-9 ,.;:'!?%$&-]+$")


@dataclass(frozen=True)
class Sentence:
    text: str
    paragraph: str  # "source:index", the unit of the train/dev split


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # a few State of the Union files are ISO-8859-1
        return raw.decode("latin-1")


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph: cut after . ! ? before a capital, not after an abbreviation."""
    text = " ".join(paragraph.translate(_TYPOGRAPHY).split())
    parts = _SPLIT.split(text)
    out: list[str] = []
    for p in parts:
        if out and _ABBREV.search(out[-1]):
            out[-1] += " " + p
        else:
            out.append(p)
    return out


def keep(sentence: str, min_words: int, max_words: int) -> bool:
    words = sentence.split()
    return (min_words <= len(words) <= max_words and _ALLOWED.match(sentence) is not None
            and sentence[0].isupper() and sentence[-1] in ".!?" and not sentence.isupper()
            and "--" not in sentence and "'" not in sentence[:1])


def paragraphs(corpus: Path, squad: Path | None) -> list[tuple[str, str]]:
    """(paragraph id, text) for every paragraph of the sources, in a fixed order."""
    out: list[tuple[str, str]] = []
    for pattern in CORPUS_GLOBS:
        files = sorted(corpus.glob(pattern))
        if not files:
            raise SystemExit(f"{corpus}/{pattern}: no files (expected the shared corpus folder)")
        for path in files:
            blocks = re.split(r"\n\s*\n", _read_text(path).replace("\r", ""))
            for i, block in enumerate(blocks):
                if block.strip():
                    out.append((f"{path.parent.name}/{path.name}:{i}", block))
    if squad is not None:
        data = json.loads(squad.read_text(encoding="utf-8"))["data"]
        for article in data:
            for i, p in enumerate(article["paragraphs"]):
                out.append((f"squad/{article['title']}:{i}", p["context"]))
    return out


def is_dev(paragraph_id: str, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{paragraph_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < DEV_PERCENT


def sentence_pools(corpus: Path, squad: Path | None, seed: int, min_words: int,
                   max_words: int) -> dict[str, list[list[Sentence]]]:
    """{"train": [...], "dev": [...]}: lists of paragraphs, each a list of kept sentences
    (duplicates across the corpus dropped; first occurrence wins)."""
    seen: set[str] = set()
    pools: dict[str, list[list[Sentence]]] = {"train": [], "dev": []}
    for pid, text in paragraphs(corpus, squad):
        kept = []
        for s in split_sentences(text):
            if keep(s, min_words, max_words) and s.lower() not in seen:
                seen.add(s.lower())
                kept.append(Sentence(s, pid))
        if kept:
            pools["dev" if is_dev(pid, seed) else "train"].append(kept)
    return pools


# ------------------------------------------------------------------------------ words


_WORD = re.compile(r"^([^A-Za-z0-9]*)([A-Za-z0-9][A-Za-z0-9'%$&-]*[A-Za-z0-9%]|[A-Za-z0-9])([^A-Za-z0-9%]*)$")


class Words:
    """A sentence as whitespace tokens, each split into leading punctuation, core and trailing
    punctuation, so edits replace cores and keep punctuation and capitals."""

    def __init__(self, text: str):
        self.tokens = text.split()

    def core(self, i: int) -> str:
        m = _WORD.match(self.tokens[i])
        return m.group(2) if m else ""

    def lower(self, i: int) -> str:
        return self.core(i).lower()

    def bare(self, i: int) -> bool:
        """No punctuation attached (a swap or drop cannot move a comma or full stop)."""
        m = _WORD.match(self.tokens[i])
        return bool(m) and not m.group(1) and not m.group(3)

    def set_core(self, i: int, word: str) -> None:
        """Replace token ``i``'s core; a capital on the old word carries over to the new one."""
        m = _WORD.match(self.tokens[i])
        if m.group(2)[:1].isupper() and word[:1].islower():
            word = word[:1].upper() + word[1:]
        self.tokens[i] = m.group(1) + word + m.group(3)

    def put_core(self, i: int, word: str) -> None:
        """Replace token ``i``'s core with ``word`` as it is (swaps move words with their case)."""
        m = _WORD.match(self.tokens[i])
        self.tokens[i] = m.group(1) + word + m.group(3)

    def text(self) -> str:
        out = " ".join(t for t in self.tokens if t)
        out = re.sub(r"\s+([,.;:!?])", r"\1", out)
        return out[:1].upper() + out[1:]


def lexicon(groups: tuple[str, ...], split: str, seed: int) -> dict[str, list[str]]:
    """The word groups ('a b c': every word maps to the others) of one split. A third of the
    groups (by a hash) serve dev only and the rest train only, so a dev pair is not judged by
    memorising the training lists but by what the model knows of the words."""
    out: dict[str, list[str]] = collections.defaultdict(list)
    for g in groups:
        in_dev = hashlib.sha256(f"{seed}:{g}".encode()).digest()[0] % 3 == 0
        if in_dev != (split == "dev"):
            continue
        words = g.split()
        for w in words:
            out[w].extend(x for x in words if x != w)
    return dict(out)


# Meaning-preserving substitutions (context-blind: some are wrong in some sentences).
SYNONYM_GROUPS = (
    "big large", "begin start", "began started", "begins starts", "help assist", "helped assisted",
    "buy purchase", "bought purchased", "show demonstrate", "quick fast", "quickly rapidly",
    "nearly almost", "perhaps maybe", "often frequently", "enough sufficient", "large sizeable",
    "end finish", "ended finished", "choose select", "chose selected", "chosen selected", "need require",
    "needs requires", "needed required", "try attempt", "tried attempted", "get obtain", "got obtained",
    "give provide", "gave provided", "gives provides", "kept retained", "answer reply", "area region",
    "areas regions", "job task", "jobs tasks", "goal aim", "goals aims", "idea notion", "ideas notions",
    "country nation", "countries nations", "people persons", "rich wealthy", "poor needy", "sick ill",
    "hard difficult", "easy simple", "strong powerful", "freedom liberty", "enemy foe",
    "enemies foes", "world globe", "war conflict", "wars conflicts", "aid assistance", "chance opportunity",
    "chances opportunities", "plan scheme", "plans schemes", "speak talk", "spoke talked",
    "said stated", "says states", "tell inform", "told informed", "keep retain", "build construct",
    "built constructed", "fix repair", "fixed repaired", "stop halt", "stopped halted", "wish desire",
    "wished desired", "seem appear", "seems appears", "seemed appeared", "house home", "houses homes",
    "car automobile", "cars automobiles", "mistake error", "mistakes errors", "shut closed",
    "town city", "towns cities", "journey trip", "happy glad", "sad unhappy",
    "afraid frightened", "angry furious", "ancient old", "fine excellent", "huge enormous",
    "main principal", "whole entire", "total complete", "entire complete", "mostly largely",
    "among amongst", "while whilst", "toward towards", 
    "although though", "however nevertheless", "therefore thus", "above over",
    "under beneath", "purpose aim", "vital essential", "crucial essential",
    "improve enhance", "improved enhanced", "increase raise", "increased raised", "reduce lower",
    "reduced lowered", "prevent avert", "protect defend", "protected defended", "guard protect",
    "strength power", "wealth riches", "labor work", "labour work", "duty obligation",
    "duties obligations", "citizens nationals", "leaders chiefs", "leader chief", "nearly roughly",
    "final last", "earlier previous", "former previous", "modern contemporary",
    "several various", "various diverse", "allow permit", "allowed permitted", "allows permits",
    "want wish", "wanted wished", "understand comprehend", "understood comprehended",
)
ANTONYM_GROUPS = (
    "increase decrease", "increased decreased", "increases decreases", "increasing decreasing",
    "more less", "most least", "first last", "before after", "good bad", "better worse", "best worst",
    "rise fall", "rose fell", "rising falling", "win lose", "won lost", "accept reject", "accepted rejected",
    "open close", "opened closed", "always never", "high low", "higher lower", "highest lowest", 
    "many few", "strong weak", "stronger weaker", "rich poor", "large small", "larger smaller",
    "largest smallest", "big small", "long short", "longer shorter", "early late", "earlier later",
    "young old", "new old", "true false", "right wrong", "success failure", "peace war", "friend enemy",
    "friends enemies", "love hate", "loved hated", "agree disagree", "agreed disagreed", "possible impossible",
    "legal illegal", "public private", "inside outside", "north south", "east west", "northern southern",
    "eastern western", "domestic foreign", "above below", "upper lower", "hot cold", "warm cool",
    "easy difficult", "easier harder", "safe dangerous", "support oppose", "supported opposed",
    "allow forbid", "allowed forbade", "include exclude", "included excluded", "success defeat",
    "victory defeat", "lead follow", "remember forget", "remembered forgot", "give take", "gave took",
    "buy sell", "bought sold", "import export", "imports exports", "export import", "enter leave",
    "entered left", "begin end", "began ended", "start finish", "started finished", "love fear",
    "happy unhappy", "wise foolish", "clear unclear", "certain uncertain", "full empty", "together apart",
    "ancient modern", "same different", "common rare", "maximum minimum",
    "majority minority", "gain loss", "gains losses", "profit loss", "strength weakness", "attack defend",
    "attacked defended", "dark light", "heavy light", "slow fast", "slowly quickly", "often rarely",
    "everything nothing", "everyone nobody", "someone nobody", "ever never", "yes no", "up down",
)
CONTRACTIONS = [("do not", "don't"), ("does not", "doesn't"), ("did not", "didn't"), ("is not", "isn't"),
                ("are not", "aren't"), ("was not", "wasn't"), ("were not", "weren't"), ("have not", "haven't"),
                ("has not", "hasn't"), ("had not", "hadn't"), ("will not", "won't"), ("cannot", "can't"),
                ("would not", "wouldn't"), ("should not", "shouldn't"), ("could not", "couldn't"),
                ("must not", "mustn't"), ("it is", "it's"), ("we are", "we're"), ("we will", "we'll"),
                ("we have", "we've"), ("i am", "i'm"), ("they are", "they're"), ("that is", "that's"),
                ("let us", "let's"), ("you are", "you're"), ("there is", "there's"), ("i have", "i've")]
DROPPABLE = {"very", "really", "quite", "indeed", "certainly", "truly", "greatly", "actually", "simply",
             "clearly", "surely", "deeply", "particularly", "especially", "still", "now"}
OPENERS = {"however", "moreover", "indeed", "furthermore", "nevertheless", "besides", "still", "thus",
           "therefore", "yet", "now", "so", "and", "but", "also", "finally", "meanwhile", "instead"}
FRONT_PREPOSITIONS = {"in", "on", "at", "during", "after", "before", "since", "for", "over", "under",
                      "throughout", "within", "by", "until", "through", "from"}
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "fifteen", "twenty", "thirty", "forty", "fifty", "hundred"]
NUMBER_VALUES = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 20, 30, 40, 50, 100]
PRONOUN_SWAPS = {"we": "they", "they": "we", "our": "their", "their": "our", "us": "them", "them": "us",
                 "he": "she", "she": "he", "his": "her", "him": "her", "i": "you", "my": "your", "me": "you",
                 "ours": "theirs", "theirs": "ours"}
NEGATABLE = {"is", "are", "was", "were", "will", "can", "could", "should", "would", "must", "has", "have",
             "had", "does", "do", "did", "may", "might", "shall"}
STOPWORDS = set("""a an the and or but if of in on at to for by with from as into onto upon about over under
after before between through during without within is are was were be been being am do does did have has had
will would shall should can could may might must not no nor so than then that this these those there here it
its it's he him his she her hers they them their theirs we us our ours you your yours i me my mine who whom whose
which what when where why how all any both each every few many more most much other some such only own same too
very just also again ever never once now still yet one two three upon shall thus""".split())


# ------------------------------------------------------------------------------ paraphrase edits


def _candidates(w: Words, pred) -> list[int]:
    return [i for i in range(len(w.tokens)) if w.core(i) and pred(i)]


def make_substitution(table: dict[str, list[str]], name: str):
    """An edit that replaces one word found in ``table`` by one of its partners there."""
    def edit(s: str, rng: random.Random) -> str | None:
        w = Words(s)
        idx = _candidates(w, lambda i: w.lower(i) in table)
        if not idx:
            return None
        i = rng.choice(idx)
        w.set_core(i, rng.choice(table[w.lower(i)]))
        return w.text()
    edit.__name__ = f"edit_{name}"
    return edit


def edit_contraction(s: str, rng: random.Random) -> str | None:
    """Make or undo one contraction (do not <-> don't, it is <-> it's)."""
    options = []
    for long, short in CONTRACTIONS:
        for a, b in ((long, short), (short, long)):
            # contract only before a word: 'sure it is, for' must not become 'sure it's, for'
            follow = r"(?= [A-Za-z])" if b == short else ""
            for m in re.finditer(rf"(?i)\b{re.escape(a)}\b{follow}", s):
                options.append((m.start(), m.end(), b))
    if not options:
        return None
    start, end, repl = rng.choice(options)
    if s[start].isupper():
        repl = repl[0].upper() + repl[1:]
    out = s[:start] + repl + s[end:]
    return re.sub(r"\bi\b", "I", re.sub(r"\bi'", "I'", out))


def edit_drop_adverb(s: str, rng: random.Random) -> str | None:
    w = Words(s)
    idx = _candidates(w, lambda i: w.lower(i) in DROPPABLE and w.bare(i) and 0 < i < len(w.tokens) - 1)
    if not idx:
        return None
    w.tokens[rng.choice(idx)] = ""
    return w.text()


def edit_coordination(s: str, rng: random.Random) -> str | None:
    """'peace and freedom,' -> 'freedom and peace,' (two content words around 'and', the second
    closing a phrase with punctuation, so that a verb is not swapped with a noun)."""
    w = Words(s)
    t = w.tokens
    idx = [i for i in range(1, len(t) - 1) if t[i] == "and" and w.bare(i - 1) and w.core(i + 1)
           and not w.bare(i + 1) and t[i + 1][-1] in ",.;:!?"
           and w.lower(i - 1) not in STOPWORDS and w.lower(i + 1) not in STOPWORDS
           and len(w.core(i - 1)) > 2 and len(w.core(i + 1)) > 2 and w.core(i - 1).islower()
           and w.core(i + 1).islower() and w.lower(i - 1) != w.lower(i + 1)]
    if not idx:
        return None
    i = rng.choice(idx)
    a, b = w.core(i - 1), w.core(i + 1)
    w.put_core(i - 1, b)
    w.put_core(i + 1, a)
    return w.text()


def edit_front_phrase(s: str, rng: random.Random) -> str | None:
    """'In 1990, we did X.' -> 'We did X in 1990.' (an opening phrase of 2-8 words)."""
    t = s.split()
    if t[0].lower() not in FRONT_PREPOSITIONS:
        return None
    for k in range(1, min(8, len(t) - 3)):
        if t[k].endswith(","):
            phrase = " ".join(t[: k + 1])[:-1]
            rest = t[k + 1:]
            if not rest or not rest[-1][-1] in ".!?" or "," in phrase:
                return None
            end = rest[-1][-1]
            rest[-1] = rest[-1][:-1]
            head = rest[0]
            if head[:1].islower():
                rest[0] = head[0].upper() + head[1:]
            phrase = phrase[0].lower() + phrase[1:]
            return " ".join(rest) + " " + phrase + end
    return None


def edit_number_format(s: str, rng: random.Random) -> str | None:
    """'three' <-> '3', 'percent' <-> 'per cent'."""
    w = Words(s)
    idx = _candidates(w, lambda i: w.lower(i) in NUMBER_WORDS[1:13] or w.core(i) in [str(n) for n in range(1, 13)]
                      or w.lower(i) == "percent")
    if not idx:
        return None
    i = rng.choice(idx)
    c = w.lower(i)
    if c == "percent":
        w.set_core(i, "per cent")
    elif c.isdigit():
        w.set_core(i, NUMBER_WORDS[NUMBER_VALUES.index(int(c))])
    else:
        w.set_core(i, str(NUMBER_VALUES[NUMBER_WORDS.index(c)]))
    return w.text()


def edit_drop_opener(s: str, rng: random.Random) -> str | None:
    t = s.split()
    if len(t) < 6 or not t[0].endswith(",") or t[0][:-1].lower() not in OPENERS:
        return None
    rest = t[1:]
    rest[0] = rest[0][0].upper() + rest[0][1:]
    return " ".join(rest)


PRESERVING = (edit_contraction, edit_drop_adverb, edit_coordination, edit_front_phrase, edit_number_format,
              edit_drop_opener)  # and the synonyms of the split


def edit_negation(s: str, rng: random.Random) -> str | None:
    """Remove a 'not'/'n't'/'never', or put 'not' after an auxiliary."""
    removals = [(m.start(), m.end(), r) for pat, r in ((r"\bnot ", ""), (r"\bcannot\b", "can"),
                                                       (r"\bnever\b", "always"), (r"n't\b", ""))
                for m in re.finditer(pat, s)]
    w = Words(s)
    adds = _candidates(w, lambda i: w.lower(i) in NEGATABLE and w.bare(i) and 0 < i < len(w.tokens) - 1
                       and w.lower(i + 1) not in ("not", "never"))
    if removals and (not adds or rng.random() < 0.5):
        start, end, repl = rng.choice(removals)
        out = s[:start] + repl + s[end:]
        out = out.replace("wo ", "will ").replace("ca ", "can ")  # won't -> wo, can't -> ca
        return " ".join(out.split())
    if not adds:
        return None
    i = rng.choice(adds)
    w.tokens[i] = "cannot" if w.lower(i) == "can" else w.tokens[i] + " not"
    return w.text()


def edit_number(s: str, rng: random.Random) -> str | None:
    """Change one number: a year by 1-30, another number to a different value."""
    w = Words(s)
    idx = _candidates(w, lambda i: re.fullmatch(r"\d[\d,]*", w.core(i)) is not None
                      or w.lower(i) in NUMBER_WORDS[1:])
    if not idx:
        return None
    i = rng.choice(idx)
    c = w.core(i)
    if c.lower() in NUMBER_WORDS:
        w.set_core(i, rng.choice([x for x in NUMBER_WORDS[2:] if x != c.lower()]))
    else:
        n = int(c.replace(",", ""))
        if 1700 <= n <= 2030 and "," not in c:
            new = n + rng.choice([-1, 1]) * rng.randint(1, 30)
        else:
            new = max(0, n + rng.choice([-1, 1]) * max(1, int(n * rng.uniform(0.2, 0.9))))
            new = new if new != n else n + 1
        w.set_core(i, f"{new:,}" if "," in c else str(new))
    return w.text()


def edit_swap_names(s: str, rng: random.Random) -> str | None:
    """Swap two different capitalised words that are not the first word (names, places)."""
    w = Words(s)
    idx = _candidates(w, lambda i: i > 0 and w.core(i)[:1].isupper() and w.core(i).isalpha()
                      and w.core(i) not in ("I",) and not w.tokens[i - 1].endswith((".", ":")))
    distinct = {w.core(i) for i in idx}
    if len(distinct) < 2:
        return None
    i = rng.choice(idx)
    j = rng.choice([k for k in idx if w.core(k) != w.core(i)])
    a, b = w.core(i), w.core(j)
    w.put_core(i, b)
    w.put_core(j, a)
    return w.text()


def edit_pronoun(s: str, rng: random.Random) -> str | None:
    w = Words(s)
    idx = _candidates(w, lambda i: w.lower(i) in PRONOUN_SWAPS)
    if not idx:
        return None
    i = rng.choice(idx)
    new = PRONOUN_SWAPS[w.lower(i)]
    w.set_core(i, "I" if new == "i" else new)
    return w.text()


def make_edit_replace_word(vocab: list[str]):
    def edit_replace_word(s: str, rng: random.Random) -> str | None:
        """A content word (6+ letters) replaced by another corpus word of similar length."""
        w = Words(s)
        idx = _candidates(w, lambda i: w.core(i).islower() and w.core(i).isalpha() and len(w.core(i)) >= 6
                          and w.lower(i) not in STOPWORDS)
        if not idx:
            return None
        i = rng.choice(idx)
        old = w.core(i)
        for _ in range(20):
            new = rng.choice(vocab)
            if new != old and abs(len(new) - len(old)) <= 2 and new[-1:] == old[-1:]:
                w.set_core(i, new)
                return w.text()
        return None
    return edit_replace_word


def _apply_some(s: str, edits, rng: random.Random, k: int) -> tuple[str, list[str]]:
    """Apply up to ``k`` edits drawn in random order; the names of those that applied."""
    names = []
    for edit in rng.sample(list(edits), len(edits)):
        if len(names) >= k:
            break
        out = edit(s, rng)
        if out is not None and out != s:
            s, names = out, names + [edit.__name__[5:]]
    return s, names


def paraphrase_pairs(paras: list[list[Sentence]], n: int, rng: random.Random, vocab: list[str],
                     synonyms: dict[str, list[str]], antonyms: dict[str, list[str]],
                     positive_share: float = 2 / 3) -> list[tuple[str, str, str, str]]:
    """``n`` (label, sentence1, sentence2, op) rows from the paragraphs of one split, with the
    split's own word lists and replacement vocabulary."""
    preserving = PRESERVING + (make_substitution(synonyms, "synonym"),)
    changing = (make_substitution(antonyms, "antonym"), edit_negation, edit_number, edit_swap_names, edit_pronoun,
                make_edit_replace_word(vocab))
    sentences = [s for p in paras for s in p if 10 <= len(s.text.split()) <= 40]
    by_para = collections.defaultdict(list)
    for s in sentences:
        by_para[s.paragraph].append(s.text)
    rng.shuffle(sentences)
    rows = []
    n_pos = round(n * positive_share)
    n_neg = n - n_pos
    n_other = n_neg // 4  # negatives that are another sentence of the same paragraph
    counts = collections.Counter()
    for s in sentences:
        if len(rows) >= n:
            break
        text = s.text
        want_pos = counts["pos"] < n_pos and (counts["neg"] >= n_neg or rng.random() < positive_share)
        if want_pos:
            out, names = _apply_some(text, preserving, rng, rng.randint(1, 3))
            if not names:
                continue
            label, op = "1", "+".join(names)
        elif counts["other"] < n_other and rng.random() < 0.5:
            mine = content_words(text)
            near = [t for t in by_para[s.paragraph] if t != text and len(mine & content_words(t)) >= 3]
            if not near:
                continue
            out, label, op = rng.choice(near), "0", "other_sentence"
            counts["other"] += 1
        else:
            # antonyms, names and numbers are tried more often: they apply to fewer sentences
            for edit in rng.choices(changing, weights=(4, 2, 2, 2, 2, 2), k=3):
                out = edit(text, rng)
                if out is not None and out != text:
                    break
            else:
                continue
            out, names = _apply_some(out, preserving, rng, rng.randint(0, 2))
            label, op = "0", "+".join([edit.__name__[5:]] + names)
        counts["pos" if label == "1" else "neg"] += 1
        a, b = (text, out) if rng.random() < 0.5 else (out, text)
        rows.append((label, a, b, op))
    if len(rows) < n:
        raise SystemExit(f"paraphrase: only {len(rows)} of {n} pairs could be made from this corpus")
    return rows


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in STOPWORDS and len(w) > 3}


# ------------------------------------------------------------------------------ similarity


# (kind, share of the pairs, base score): what a pair is and the score it starts from.
SIMILARITY_KINDS = (("same", 0.25, 5.0), ("one_change", 0.25, 3.4), ("two_changes", 0.15, 2.2),
                    ("related", 0.15, 1.0), ("unrelated", 0.20, 0.0))
SIMILARITY_PRESERVING_COST = 0.3  # a meaning-preserving edit lowers the score by this much
SIMILARITY_POLARITY_COST = 0.6  # an antonym or a negation: a larger change of meaning than a name or number
SIMILARITY_NOISE = 0.35  # std of the annotators' disagreement, added to every score


def similarity_pairs(paras: list[list[Sentence]], n: int, rng: random.Random, vocab: list[str],
                     synonyms: dict[str, list[str]], antonyms: dict[str, list[str]]) -> list[tuple[str, str, str, str]]:
    """``n`` (score, sentence1, sentence2, op) rows from the paragraphs of one split, scores on STS-B's
    0-5 scale in steps of 0.2 (the mean of five whole-number ratings)."""
    preserving = PRESERVING + (make_substitution(synonyms, "synonym"),)
    polarity = (make_substitution(antonyms, "antonym"), edit_negation)
    changing = polarity + (edit_number, edit_swap_names, edit_pronoun, make_edit_replace_word(vocab))
    sentences = [s for p in paras for s in p if 10 <= len(s.text.split()) <= 40]
    by_para = collections.defaultdict(list)
    for s in sentences:
        by_para[s.paragraph].append(s.text)
    rng.shuffle(sentences)
    quota = {kind: round(n * share) for kind, share, _ in SIMILARITY_KINDS}
    quota["unrelated"] += n - sum(quota.values())
    base = {kind: score for kind, _, score in SIMILARITY_KINDS}
    counts: collections.Counter = collections.Counter()
    rows = []
    for s in sentences:
        if len(rows) >= n:
            break
        text = s.text
        kind = rng.choices([k for k in quota if counts[k] < quota[k]],
                           weights=[quota[k] - counts[k] for k in quota if counts[k] < quota[k]])[0]
        score = base[kind]
        if kind == "same":
            out, names = _apply_some(text, preserving, rng, rng.randint(1, 3))
            if not names:
                continue
            score -= SIMILARITY_PRESERVING_COST * len(names)
        elif kind in ("one_change", "two_changes"):
            out, names = text, []
            for edit in rng.sample(changing, len(changing)):
                if len(names) == (1 if kind == "one_change" else 2):
                    break
                new = edit(out, rng)
                if new is not None and new != out:
                    out, names = new, names + [edit.__name__[5:]]
                    score -= SIMILARITY_POLARITY_COST if edit in polarity else 0.0
            if len(names) < (1 if kind == "one_change" else 2):
                continue
            out, kept = _apply_some(out, preserving, rng, rng.randint(0, 2))
            score -= SIMILARITY_PRESERVING_COST * len(kept)
            names += kept
        elif kind == "related":
            mine = content_words(text)
            near = [t for t in by_para[s.paragraph] if t != text and len(mine & content_words(t)) >= 2]
            if not near:
                continue
            out = rng.choice(near)
            names = ["related"]
            score += 0.2 * min(len(mine & content_words(out)), 5)
        else:
            other = rng.choice(sentences)
            if other.paragraph == s.paragraph:
                continue
            out, names = other.text, ["unrelated"]
            score += 0.2 * min(len(content_words(text) & content_words(out)), 2)
        score = min(5.0, max(0.0, score + rng.gauss(0.0, SIMILARITY_NOISE)))
        counts[kind] += 1
        a, b = (text, out) if rng.random() < 0.5 else (out, text)
        rows.append((f"{round(score * 5) / 5:.1f}", a, b, kind + ":" + "+".join(names)))
    if len(rows) < n:
        raise SystemExit(f"similarity: only {len(rows)} of {n} pairs could be made from this corpus")
    return rows


# ------------------------------------------------------------------------------ acceptability edits

AGREEMENT = {"is": "are", "are": "is", "was": "were", "were": "was", "has": "have", "have": "has", "does": "do",
             "do": "does", "this": "these", "these": "this", "that": "those", "those": "that"}
CASE = {"we": "us", "us": "we", "they": "them", "them": "they", "he": "him", "him": "he", "she": "her",
        "i": "me", "me": "I", "who": "whom"}
DROP_FUNCTION = {"the", "a", "an", "to", "of", "in", "is", "are", "was", "were", "be", "has", "have", "with",
                 "for", "on", "by", "it", "we", "will", "that", "and", "been", "not"}
MODALS = {"will", "can", "must", "should", "would", "could", "may", "might", "shall", "to", "cannot"}
# Base verb -> wrong forms after a modal or 'to'.
VERB_FORMS = {
    "be": ["is", "being", "been"], "have": ["has", "had", "having"], "do": ["does", "did", "done"],
    "make": ["makes", "made", "making"], "take": ["takes", "took", "taken"], "give": ["gives", "gave", "given"],
    "go": ["goes", "went", "gone"], "see": ["sees", "saw", "seen"], "come": ["comes", "came"],
    "know": ["knows", "knew", "known"], "get": ["gets", "got"], "find": ["finds", "found"],
    "keep": ["keeps", "kept"], "bring": ["brings", "brought"], "help": ["helps", "helped"],
    "meet": ["meets", "met"], "build": ["builds", "built"], "continue": ["continues", "continued"],
    "provide": ["provides", "provided"], "become": ["becomes", "became"], "work": ["works", "worked"],
    "seek": ["seeks", "sought"], "pay": ["pays", "paid"], "win": ["wins", "won"], "protect": ["protects",
                                                                                             "protected"],
    "say": ["says", "said"], "think": ["thinks", "thought"], "tell": ["tells", "told"], "leave": ["leaves", "left"],
    "carry": ["carries", "carried"], "write": ["writes", "wrote", "written"], "feel": ["feels", "felt"],
    "speak": ["speaks", "spoke", "spoken"], "hold": ["holds", "held"], "stand": ["stands", "stood"],
    "use": ["uses", "used"], "try": ["tries", "tried"], "let": ["lets"], "put": ["puts"], "act": ["acts", "acted"],
    "serve": ["serves", "served"], "begin": ["begins", "began", "begun"], "grow": ["grows", "grew", "grown"],
    "show": ["shows", "showed", "shown"], "ask": ["asks", "asked"], "live": ["lives", "lived"],
    "reduce": ["reduces", "reduced"], "increase": ["increases", "increased"], "achieve": ["achieves", "achieved"],
    "remain": ["remains", "remained"], "allow": ["allows", "allowed"], "strengthen": ["strengthens",
                                                                                     "strengthened"],
}


def corrupt_swap(s: str, rng: random.Random) -> str | None:
    """Two adjacent words swapped (punctuation stays where it was)."""
    w = Words(s)
    idx = [i for i in range(len(w.tokens) - 1) if w.core(i) and w.core(i + 1) and w.bare(i)
           and w.lower(i) != w.lower(i + 1)]
    if not idx:
        return None
    i = rng.choice(idx)
    a, b = w.core(i), w.core(i + 1)
    if i == 0 and a != "I" and a[1:].islower():  # the old first word moves inside: lower it
        a = a.lower()
    if i == 0:
        w.set_core(0, b)
    else:
        w.put_core(i, b)
    w.put_core(i + 1, a)
    return w.text()


def corrupt_shuffle3(s: str, rng: random.Random) -> str | None:
    w = Words(s)
    idx = [i for i in range(1, len(w.tokens) - 3) if all(w.bare(i + k) for k in range(3))]
    if not idx:
        return None
    i = rng.choice(idx)
    span = w.tokens[i:i + 3]
    for _ in range(5):
        shuffled = rng.sample(span, 3)
        if shuffled != span:
            w.tokens[i:i + 3] = shuffled
            return w.text()
    return None


def corrupt_drop(s: str, rng: random.Random) -> str | None:
    w = Words(s)
    idx = _candidates(w, lambda i: 0 < i < len(w.tokens) - 1 and w.bare(i) and w.lower(i) in DROP_FUNCTION)
    if not idx:
        return None
    w.tokens[rng.choice(idx)] = ""
    return w.text()


def corrupt_double(s: str, rng: random.Random) -> str | None:
    w = Words(s)
    idx = _candidates(w, lambda i: 0 < i < len(w.tokens) - 1 and w.bare(i))
    if not idx:
        return None
    i = rng.choice(idx)
    w.tokens[i] = w.tokens[i] + " " + w.tokens[i]
    return w.text()


def corrupt_agreement(s: str, rng: random.Random) -> str | None:
    w = Words(s)
    idx = _candidates(w, lambda i: w.lower(i) in AGREEMENT or (w.lower(i) in ("a", "an") and i + 1 < len(w.tokens)
                                                                and w.core(i + 1)))
    if not idx:
        return None
    i = rng.choice(idx)
    c = w.lower(i)
    w.set_core(i, {"a": "an", "an": "a"}.get(c) or AGREEMENT[c])
    return w.text()


def corrupt_case(s: str, rng: random.Random) -> str | None:
    w = Words(s)
    idx = _candidates(w, lambda i: w.lower(i) in CASE)
    if not idx:
        return None
    i = rng.choice(idx)
    w.set_core(i, CASE[w.lower(i)])
    return w.text()


def corrupt_verb_form(s: str, rng: random.Random) -> str | None:
    w = Words(s)
    idx = _candidates(w, lambda i: i > 0 and w.lower(i - 1) in MODALS and w.bare(i - 1) and w.lower(i) in VERB_FORMS)
    if not idx:
        return None
    i = rng.choice(idx)
    w.set_core(i, rng.choice(VERB_FORMS[w.lower(i)]))
    return w.text()


CORRUPTIONS = (corrupt_swap, corrupt_shuffle3, corrupt_drop, corrupt_double, corrupt_agreement, corrupt_case,
               corrupt_verb_form)
# How often each is tried: the targeted ones (agreement, case, verb form) more, the blunt
# doubling less (it is the easiest to spot).
CORRUPTION_WEIGHTS = (3, 1, 3, 1, 4, 2, 2)


def acceptability_rows(paras: list[list[Sentence]], n: int, rng: random.Random,
                       acceptable_share: float = 0.70) -> list[tuple[str, str, str]]:
    """``n`` (sentence, label, op) rows from the paragraphs of one split."""
    sentences = [s.text for p in paras for s in p if len(s.text.split()) <= 25]
    rng.shuffle(sentences)
    n_good = round(n * acceptable_share)
    rows = []
    counts = collections.Counter()
    for text in sentences:
        if len(rows) >= n:
            break
        if counts["1"] < n_good and (counts["0"] >= n - n_good or rng.random() < acceptable_share):
            rows.append((text, "1", "original"))
            counts["1"] += 1
            continue
        for corrupt in rng.choices(CORRUPTIONS, weights=CORRUPTION_WEIGHTS, k=3):
            out = corrupt(text, rng)
            if out is not None and out != text:
                rows.append((out, "0", corrupt.__name__[8:]))
                counts["0"] += 1
                break
    if len(rows) < n:
        raise SystemExit(f"acceptability: only {len(rows)} of {n} sentences could be made from this corpus")
    return rows


# ------------------------------------------------------------------------------ files


def _write_tsv(path: Path, header: tuple[str, ...], rows) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write("\t".join(header) + "\n")
        for row in rows:
            cells = [" ".join(c.replace('"', "").split()) for c in row]
            f.write("\t".join(cells) + "\n")
    tmp.replace(path)


SIZES = {"paraphrase": (3668, 408), "acceptability": (8551, 1043), "similarity": (5749, 1500)}  # MRPC's, CoLA's, STS-B's


def build(corpus: Path, squad: Path | None, out: Path, seed: int = 13,
          tasks: tuple[str, ...] = ("paraphrase", "acceptability", "similarity")) -> dict:
    """Write ``out/<task>/{train,dev}.tsv`` for each task; return counts per file and op."""
    pools = sentence_pools(corpus, squad, seed, 5, 40)
    stats: dict = {"seed": seed, "train_paragraphs": len(pools["train"]), "dev_paragraphs": len(pools["dev"])}
    for task in tasks:
        (out / task).mkdir(parents=True, exist_ok=True)
        for split, n in zip(("train", "dev"), SIZES[task]):
            rng = random.Random(f"{seed}:{task}:{split}")
            vocab = sorted({w for p in pools[split] for s in p for w in re.findall(r"\b[a-z]{6,}\b", s.text)})
            if task == "paraphrase":
                rows = paraphrase_pairs(pools[split], n, rng, vocab, lexicon(SYNONYM_GROUPS, split, seed),
                                        lexicon(ANTONYM_GROUPS, split, seed))
                _write_tsv(out / task / f"{split}.tsv", ("label", "sentence1", "sentence2", "op"), rows)
                labels = [r[0] for r in rows]
                ops = collections.Counter(r[3].split("+")[0] if r[0] == "0" else "preserving" for r in rows)
            elif task == "similarity":
                rows = similarity_pairs(pools[split], n, rng, vocab, lexicon(SYNONYM_GROUPS, split, seed),
                                        lexicon(ANTONYM_GROUPS, split, seed))
                _write_tsv(out / task / f"{split}.tsv", ("label", "sentence1", "sentence2", "op"), rows)
                scores = [float(r[0]) for r in rows]
                stats[f"{task}/{split}"] = {"rows": len(rows), "mean_score": round(sum(scores) / len(scores), 3),
                                            "ops": dict(sorted(collections.Counter(r[3].split(":")[0] for r in rows).items()))}
                continue
            else:
                rows = acceptability_rows(pools[split], n, rng)
                _write_tsv(out / task / f"{split}.tsv", ("sentence", "label", "op"), rows)
                labels = [r[1] for r in rows]
                ops = collections.Counter(r[2] for r in rows)
            stats[f"{task}/{split}"] = {"rows": len(rows), "positive": labels.count("1"), "ops": dict(sorted(ops.items()))}
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, required=True, help="the shared corpus folder (inaugural/, state_union/, "
                                                              "gutenberg/)")
    p.add_argument("--squad", type=Path, default=None, help="SQuAD v1.1 JSON whose contexts add sentences "
                                                            "(default: none)")
    p.add_argument("--out", type=Path, required=True, help="folder for paraphrase/, acceptability/ and similarity/")
    p.add_argument("--seed", type=int, default=13, help="data seed (default 13)")
    p.add_argument("--tasks", default="paraphrase,acceptability,similarity",
                   help="default: paraphrase,acceptability,similarity")
    a = p.parse_args(argv)
    stats = build(a.corpus, a.squad, a.out, a.seed, tuple(a.tasks.split(",")))
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
