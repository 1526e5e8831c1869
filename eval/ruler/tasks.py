"""The 13 RULER tasks (RULER's ``scripts/synthetic.yaml``) and their verbatim prompt texts (RULER's
``scripts/data/synthetic/constants.py`` and task scripts)."""

from __future__ import annotations

from dataclasses import dataclass


class TaskDataMissing(FileNotFoundError):
    """A task needs data that is not available locally (a QA JSON file, or the essay package).

    The message names what is missing and how to provide it; a runner may skip the task with it.
    """


@dataclass(frozen=True)
class TaskConfig:
    """One RULER task: generator ``kind``, default ``haystack``, generation budget and metric."""

    name: str
    kind: str  # niah | vt | cwe | fwe | qa
    haystack: str  # noise | essay | needle | words | coded_words | documents
    tokens_to_generate: int
    metric: str  # string_match_all | string_match_part
    key_type: str | None = None  # niah: words | numbers | uuids
    value_type: str | None = None
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    num_chains: int = 1  # vt
    num_hops: int = 4  # vt
    num_cw: int = 10  # cwe: number of common words (the answers)
    alpha: float = 2.0  # fwe: Zipf exponent
    dataset: str | None = None  # qa: squad | hotpotqa


def _niah(name: str, haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1) -> TaskConfig:
    return TaskConfig(name, "niah", haystack, 128, "string_match_all", key, value, max(k, q), v, q)


#: The 13 RULER tasks. niah_multiquery has ``num_keys = max(k, q) = 4`` as RULER computes it.
TASKS: dict[str, TaskConfig] = {
    cfg.name: cfg
    for cfg in (
        _niah("niah_single_1", "noise", "words", "numbers"),
        _niah("niah_single_2", "essay", "words", "numbers"),
        _niah("niah_single_3", "essay", "words", "uuids"),
        _niah("niah_multikey_1", "essay", "words", "numbers", k=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "essay", "words", "numbers", v=4),
        _niah("niah_multiquery", "essay", "words", "numbers", q=4),
        TaskConfig("vt", "vt", "noise", 30, "string_match_all", num_chains=1, num_hops=4),
        TaskConfig("cwe", "cwe", "words", 120, "string_match_all", num_cw=10),
        TaskConfig("fwe", "fwe", "coded_words", 50, "string_match_all", alpha=2.0),
        TaskConfig("qa_1", "qa", "documents", 32, "string_match_part", dataset="squad"),
        TaskConfig("qa_2", "qa", "documents", 32, "string_match_part", dataset="hotpotqa"),
    )
}

#: The default haystacks that the ``haystack`` argument of ``generate_samples`` may replace.
OVERRIDABLE = ("noise", "essay")

# --------------------------------------------------------------------------------------------------
# Verbatim RULER text (scripts/data/synthetic/constants.py and the task scripts)

NOISE_UNIT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
    "the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
