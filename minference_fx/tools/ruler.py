"""Long-context tasks after RULER, beyond the single needle.

The tasks follow the definitions in Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?" (arXiv 2404.06654). The prompts, word lists and code here are this project's
own. Each task has a generator (tokenizer, haystack text, target length, seed -> :class:`RulerSample`: the
prompt ids and the strings a right answer contains). One scorer serves them all: RULER's all-strings match,
the fraction of expected strings found in the output.

* ``niah_multikey``     several needles of one form, "one of the secret numbers of the <key> is <7 digits>",
                        each with its own key. One key is asked; the other needles are distractors.
* ``niah_multivalue``   one key with several needles, each giving another value. All values are asked.
* ``variable_tracking`` chains of assignments hidden in the haystack ("VAR QXJKV = 40913", then
                        "VAR LMPTA = VAR QXJKV", ...). Asked: every variable that ends up holding the value.
* ``freq_words``        aggregation (RULER's frequent-words extraction). Random coded words are drawn by a
                        Zipf law (exponent 2). The most frequent is noise ("...") that the prompt says to ignore.
                        Asked: the next three. The word list is the whole context, so the haystack is unused.

Needles and assignments go at a depth of the haystack, moved back to the nearest sentence or line start, so
prose (Austen) and code (Python sources) both work. Prompts are exactly ``length`` tokens for the haystack
tasks; ``freq_words`` is exact when its noise word is one token (otherwise up to a word short).

Two prompt styles: ``chat=False`` is a plain continuation (instruction, context, question, "Answer: " and an
answer prefix), which needs no template. ``chat=True`` wraps instruction, context and question in the
tokenizer's chat template as one user turn and starts the assistant turn with the answer prefix.
"""
from __future__ import annotations

import dataclasses
import random
import string
from typing import Callable, Optional, Sequence

# ~4 characters per token in prose, ~3.5 in code; 6 leaves room and is doubled when short (indented code)
CHARS_PER_TOKEN_ROOM = 6
# how far back (tokens) an insert may move to reach a sentence or line start, at most; short prompts use
# 1/64 of the haystack, so the depth stays within ~1.5 % of the one asked
BOUNDARY_REACH = 200
BOUNDARY_ENDS = (".", "!", "?", "\n")

NEEDLE = " One of the secret numbers of the {key} is {value}. "
ASSIGN_VALUE = " VAR {name} = {value}. "
ASSIGN_NAME = " VAR {name} = VAR {source}. "
NOISE_WORD = "..."

# keys are "<adjective>-<noun>" pairs; 32 x 32 = 1024 of them
ADJECTIVES = ("amber", "azure", "brisk", "calm", "coral", "crimson", "dusty", "eager", "frosty", "gentle", "golden",
              "hollow", "humble", "icy", "jolly", "lively", "mellow", "misty", "noble", "olive", "quiet", "rapid",
              "rustic", "silent", "silver", "slate", "smoky", "sunny", "tawny", "velvet", "wild", "windy")
NOUNS = ("anchor", "badger", "beacon", "canyon", "cedar", "comet", "falcon", "ferry", "glacier", "harbor", "harp",
         "heron", "kettle", "lantern", "maple", "meadow", "orchard", "otter", "parrot", "pebble", "quarry", "raven",
         "river", "saddle", "spruce", "summit", "thistle", "tiger", "tulip", "valley", "walnut", "willow")


@dataclasses.dataclass
class RulerSample:
    """One prompt of a task and what its answer must contain."""

    task: str
    ids: list[int]
    """the whole prompt: frame before the context, the context, the question and the answer prefix"""
    answers: list[str]
    """every string a right answer contains (the score is the fraction found)"""
    new_tokens: int
    """how many tokens to decode: room for every answer plus a margin"""
    context_start: int
    """index in ``ids`` where the context (haystack with inserts, or the word list) begins"""
    context_length: int
    answer_positions: list[int] = dataclasses.field(default_factory=list)
    """index in ``ids`` of each insert that carries an answer, in the order of ``answers`` (variable tracking:
    the asked chain's assignments in order); empty for ``freq_words``"""
    depth: Optional[float] = None
    """where the first answer-carrying insert was asked to go, as a fraction of the context (None: no inserts)"""


def found(output: str, answers: Sequence[str]) -> list[bool]:
    """Per expected string, whether ``output`` holds it, ignoring case."""
    text = output.lower()
    return [a.lower() in text for a in answers]


def score(output: str, answers: Sequence[str]) -> float:
    """RULER's all-strings match: the fraction of ``answers`` found in ``output``, ignoring case.

    Extra strings in the output (a distractor's value, say) cost nothing, as in RULER.
    """
    if not answers:
        raise ValueError("score needs at least one expected answer")
    return sum(found(output, answers)) / len(answers)


# --------------------------------------------------------------------------- pieces


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def text_ids(tokenizer, text: str, n_tokens: int, rng: random.Random) -> list[int]:
    """``n_tokens`` token ids of ``text`` from a line start chosen by ``rng``.

    The window is tokenised alone, so it reads as the text does there; the start moves to the next line so it
    does not begin mid-word.
    """
    room = CHARS_PER_TOKEN_ROOM
    while True:
        need = n_tokens * room
        start = rng.randrange(0, len(text) - need + 1) if len(text) > need else 0
        if start:
            newline = text.find("\n", start, start + 2000)
            start = newline + 1 if newline >= 0 else start
        ids = _encode(tokenizer, text[start : start + need])
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        if need >= len(text):
            raise ValueError(f"a haystack of {len(text)} characters gives {len(ids)} tokens, fewer than the "
                             f"{n_tokens} needed")
        room *= 2  # denser than expected (long runs of indentation): read more characters


def _boundary(tokenizer, hay: list[int], at: int, floor: int) -> int:
    """The nearest position at or before ``at`` (not before ``floor``) that follows a sentence or line end."""
    reach = max(8, min(BOUNDARY_REACH, len(hay) // 64))
    for i in range(at, max(floor, at - reach), -1):
        if i > 0 and tokenizer.decode(hay[i - 1 : i]).rstrip(" ").endswith(BOUNDARY_ENDS):
            return i
    return at


def _with_inserts(tokenizer, haystack: str, n_tokens: int, inserts: list[tuple[float, str]],
                  rng: random.Random) -> tuple[list[int], list[int]]:
    """(``n_tokens`` ids of haystack with each ``(depth, text)`` of ``inserts`` placed, where each insert starts).

    Depth is a fraction of the haystack tokens. Inserts at equal depths keep their list order, so a chain whose
    depths do not decrease reads in order.
    """
    pieces = [_encode(tokenizer, text) for _, text in inserts]
    n_hay = n_tokens - sum(map(len, pieces))
    if n_hay < len(inserts):
        raise ValueError(f"{n_tokens} tokens cannot hold the {len(inserts)} inserts ({n_tokens - n_hay} tokens) "
                         "and a haystack; ask for a longer prompt")
    hay = text_ids(tokenizer, haystack, n_hay, rng)
    order = sorted(range(len(inserts)), key=lambda i: (inserts[i][0], i))
    out, starts, taken = [], [0] * len(inserts), 0
    for i in order:
        depth = inserts[i][0]
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"insert depth {depth} is outside [0, 1]")
        at = max(taken, _boundary(tokenizer, hay, min(n_hay, int(depth * n_hay)), taken))
        out += hay[taken:at]
        starts[i] = len(out)
        out += pieces[i]
        taken = at
    return out + hay[taken:], starts


CONTEXT_MARK = "\u27e6CONTEXT\u27e7"  # a placeholder no template rewrites, split out after rendering


def prompt_frame(tokenizer, instruction: str, question: str, answer_prefix: str,
                 chat: bool) -> tuple[list[int], list[int]]:
    """(ids before the context, ids after it: the question and the answer prefix) in the chosen style."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat prompts need a tokenizer with a chat template, and this one has none; "
                             "use chat=False (plain 'Answer:' continuation)")
        user = f"{instruction}\n\n{CONTEXT_MARK}\n\n{question}"
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)
        before, mark, after = rendered.partition(CONTEXT_MARK)
        if not mark:
            raise ValueError("the tokenizer's chat template dropped the user's message; use chat=False")
        return _encode(tokenizer, before), _encode(tokenizer, after + answer_prefix)
    # the tokenizer's own special tokens (a BOS) open the prompt, as in plain generation
    before = list(tokenizer(f"{instruction}\n\n").input_ids)
    return before, _encode(tokenizer, f"\n\n{question}\nAnswer: {answer_prefix}")


def _answer_budget(tokenizer, answers: Sequence[str]) -> int:
    """Tokens to decode: each answer with a separator, and a margin for a lead-in."""
    return sum(len(_encode(tokenizer, " " + a)) + 2 for a in answers) + 8


def _haystack_sample(task: str, tokenizer, haystack: str, length: int, rng: random.Random, *, chat: bool,
                     instruction: str, question: str, answer_prefix: str, inserts: list[tuple[float, str]],
                     answers: list[str], answer_inserts: list[int]) -> RulerSample:
    before, after = prompt_frame(tokenizer, instruction, question, answer_prefix, chat)
    n_context = length - len(before) - len(after)
    context, starts = _with_inserts(tokenizer, haystack, n_context, inserts, rng)
    return RulerSample(task, before + context + after, answers, _answer_budget(tokenizer, answers), len(before),
                       n_context, [len(before) + starts[i] for i in answer_inserts], inserts[answer_inserts[0]][0])


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), n)
    return [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]


def _numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), n)]


def _rng(task: str, length: int, seed: int) -> random.Random:
    return random.Random(f"{task}:{length}:{seed}")  # str seeds hash with sha512: the same on every run


def _check_depth(depth: float) -> None:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} is outside [0, 1]")


# --------------------------------------------------------------------------- the tasks


NIAH_INSTRUCTION = ("Some secret numbers are hidden in the long text below. Memorize them: you will be asked "
                    "about them after the text.")


def niah_multikey(tokenizer, haystack: str, length: int, seed: int, *, depth: float = 0.5, keys: int = 4,
                  chat: bool = False) -> RulerSample:
    """``keys`` needles, each with its own key and value; the first key's needle sits at ``depth``, the
    distractors at random depths. Answer: the asked key's value."""
    _check_depth(depth)
    rng = _rng("niah_multikey", length, seed)
    names, values = _keys(rng, keys), _numbers(rng, keys, 7)
    depths = [depth] + [rng.random() for _ in range(keys - 1)]
    inserts = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, names, values)]
    return _haystack_sample(
        "niah_multikey", tokenizer, haystack, length, rng, chat=chat, instruction=NIAH_INSTRUCTION,
        question=f"What is the secret number of the {names[0]} mentioned in the text above?",
        answer_prefix=f"The secret number of the {names[0]} is", inserts=inserts, answers=[values[0]],
        answer_inserts=[0])


def niah_multivalue(tokenizer, haystack: str, length: int, seed: int, *, depth: float = 0.5, values: int = 4,
                    chat: bool = False) -> RulerSample:
    """One key in ``values`` needles, each with another value; the first sits at ``depth``, the rest at random
    depths. Answer: every value."""
    _check_depth(depth)
    rng = _rng("niah_multivalue", length, seed)
    key, numbers = _keys(rng, 1)[0], _numbers(rng, values, 7)
    depths = [depth] + [rng.random() for _ in range(values - 1)]
    inserts = [(d, NEEDLE.format(key=key, value=v)) for d, v in zip(depths, numbers)]
    return _haystack_sample(
        "niah_multivalue", tokenizer, haystack, length, rng, chat=chat, instruction=NIAH_INSTRUCTION,
        question=f"What are all the secret numbers of the {key} mentioned in the text above?",
        answer_prefix=f"The secret numbers of the {key} are:", inserts=inserts, answers=numbers,
        answer_inserts=list(range(values)))


def _variable_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    return names


def variable_tracking(tokenizer, haystack: str, length: int, seed: int, *, depth: float = 0.5, hops: int = 4,
                      chains: int = 1, chat: bool = False) -> RulerSample:
    """``chains`` chains of ``hops`` + 1 assignments: a 5-digit value, then each variable set to the previous one.

    The asked chain starts at ``depth`` and its later assignments follow at random depths after it, in order;
    other chains (distractors with their own values) are spread over the whole haystack. Answer: the asked
    chain's variables.
    """
    _check_depth(depth)
    if hops < 1 or chains < 1:
        raise ValueError(f"variable tracking needs hops >= 1 and chains >= 1, got hops={hops}, chains={chains}")
    rng = _rng("variable_tracking", length, seed)
    names = _variable_names(rng, chains * (hops + 1))
    values = _numbers(rng, chains, 5)
    inserts: list[tuple[float, str]] = []
    for c in range(chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        if c == 0:  # the asked chain
            depths = [depth] + sorted(rng.uniform(depth, 1.0) for _ in range(hops))
        else:
            depths = sorted(rng.random() for _ in range(hops + 1))
        inserts.append((depths[0], ASSIGN_VALUE.format(name=chain[0], value=values[c])))
        inserts += [(d, ASSIGN_NAME.format(name=n, source=s)) for d, n, s in zip(depths[1:], chain[1:], chain)]
    asked = names[: hops + 1]
    return _haystack_sample(
        "variable_tracking", tokenizer, haystack, length, rng, chat=chat,
        instruction="Variable assignments are hidden in the long text below. Memorize them: you will be asked "
                    "to trace them after the text.",
        question=f"Following the assignments in the text above, which variables hold the value {values[0]}? "
                 "List every one of them.",
        answer_prefix=f"Following the assignments, the {hops + 1} variables holding {values[0]} are:",
        inserts=inserts, answers=asked, answer_inserts=list(range(hops + 1)))


def _zipf_counts(n_words: int, vocab: int, alpha: float) -> list[int]:
    """Occurrences of each rank (1..vocab) in ``n_words`` draws by a Zipf law, rounded down."""
    weights = [k**-alpha for k in range(1, vocab + 1)]
    total = sum(weights)
    return [int(n_words * w / total) for w in weights]


def freq_words(tokenizer, haystack: str, length: int, seed: int, *, top: int = 3, alpha: float = 2.0,
               vocab: int = 2000, word_length: int = 6, chat: bool = False) -> RulerSample:
    """A shuffled list of random coded words, ranked by a Zipf law; rank 1 is the noise word "...".

    The list is as long as the prompt allows; the noise word takes the tokens left over, so it stays the most
    frequent and the answer does not move. Answer: the ``top`` words after the noise. ``haystack`` is unused
    (the words are the context, as in RULER).
    """
    rng = _rng("freq_words", length, seed)
    words = [NOISE_WORD]
    while len(words) < vocab:
        word = "".join(rng.choices(string.ascii_lowercase, k=word_length))
        if word not in words:
            words.append(word)
    before, after = prompt_frame(
        tokenizer,
        f"Below is a text of coded words separated by spaces, and '{NOISE_WORD}' as noise. Keep count of how "
        "often each coded word appears.",
        f"Leaving out '{NOISE_WORD}', which {top} coded words appear most often in the coded text above?",
        f"Leaving out '{NOISE_WORD}', the {top} most frequent coded words are:", chat)
    n_context = length - len(before) - len(after)
    word_ids = [list(ids) for ids in tokenizer([" " + w for w in words], add_special_tokens=False).input_ids]
    sizes = [len(ids) for ids in word_ids]

    def tokens(n_words: int) -> int:
        return sum(c * s for c, s in zip(_zipf_counts(n_words, vocab, alpha), sizes))

    lo, hi = 0, max(1, n_context)  # the most words whose tokens fit: tokens() grows with n_words
    while tokens(hi) <= n_context:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tokens(mid) <= n_context else (lo, mid)
    counts = _zipf_counts(lo, vocab, alpha)
    counts[0] += (n_context - tokens(lo)) // sizes[0]
    if counts[top] <= counts[top + 1] or counts[top] < 2:
        raise ValueError(f"{length} tokens are too few to rank {top} coded words apart; ask for a longer prompt")
    order = [rank for rank, c in enumerate(counts) for _ in range(c)]
    rng.shuffle(order)
    context = [t for rank in order for t in word_ids[rank]]
    answers = words[1 : top + 1]
    return RulerSample("freq_words", before + context + after, answers, _answer_budget(tokenizer, answers),
                       len(before), len(context))


# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class RulerTask:
    name: str
    label: str
    """short column name for tables and plots"""
    generate: Callable[..., RulerSample]
    reads_haystack: bool
    """whether the haystack text (prose or code) and a depth matter; False for the aggregation task"""


TASKS = {t.name: t for t in (
    RulerTask("niah_multikey", "mk-niah", niah_multikey, True),
    RulerTask("niah_multivalue", "mv-niah", niah_multivalue, True),
    RulerTask("variable_tracking", "vt", variable_tracking, True),
    RulerTask("freq_words", "fwe", freq_words, False),
)}


def task(name: str) -> RulerTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"no RULER-style task {name!r}; known: {', '.join(TASKS)}") from None


def prompts_of(name: str, depths: Sequence[float], seeds: Sequence[int]) -> list[tuple[Optional[float], int]]:
    """The (depth, seed) of every prompt task ``name`` runs for ``depths`` x ``seeds``. The aggregation task has no
    depth, so it takes as many seeds instead (``seed * len(depths) + i``, which starts at the seeds given): every task
    then scores the same number of prompts, and one prompt of three strings does not decide its score."""
    if task(name).reads_haystack:
        return [(depth, seed) for depth in depths for seed in seeds]
    return [(None, seed * len(depths) + i) for seed in seeds for i in range(len(depths))]


def generate(name: str, tokenizer, haystack: str, length: int, seed: int, *, depth: Optional[float] = None,
             chat: bool = False) -> RulerSample:
    """A sample of task ``name``; ``depth`` (default 0.5) is passed only to the tasks that read the haystack."""
    spec = task(name)
    if not spec.reads_haystack:
        return spec.generate(tokenizer, haystack, length, seed, chat=chat)
    return spec.generate(tokenizer, haystack, length, seed, depth=0.5 if depth is None else depth, chat=chat)
