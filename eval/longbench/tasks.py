"""The LongBench tasks: LongBench's prompts, new-token budgets and metrics per task (``LongBench/config/*.json`` and
``eval.py``), the v2 prompt, task names (v1, LongBench-E ``<task>_e``, v2 ``longbench_v2[:<selector>]``) and the
score of one prediction."""

from __future__ import annotations

from collections.abc import Sequence

from hf_sparse_attn.eval.metrics import METRICS, multiple_choice_score

# LongBench/config/dataset2prompt.json (verbatim, typos included)
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
        "\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a "
        "single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, "
        "using a single phrase or sentence if possible. If the question cannot be answered based on the "
        'information in the article, write "unanswerable". If the question is a yes/no question, answer '
        '"yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer '
        "the question based on the above article as concisely as you can, using a single phrase or sentence "
        "if possible. If the question cannot be answered based on the information in the article, write "
        '"unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do '
        "not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
        "based on the above text, only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"
        "不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}"
        "\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}"
        "\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}"
        "\nAnswer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
        "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
        "\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the "
        'number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", '
        '"Paragraph 2", etc.\n\nThe answer is: '
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n"
        '{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# LongBench/config/dataset2maxlen.json
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}  # fmt: skip

# LongBench/eval.py dataset2metric
DATASET2METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1_score", "qasper": "qa_f1_score", "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score", "hotpotqa": "qa_f1_score", "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score", "dureader": "rouge_zh_score", "gov_report": "rouge_score",
    "qmsum": "rouge_score", "multi_news": "rouge_score", "vcsum": "rouge_zh_score",
    "trec": "classification_score", "triviaqa": "qa_f1_score", "samsum": "rouge_score",
    "lsht": "classification_score", "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score", "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score", "repobench-p": "code_sim_score",
}  # fmt: skip

LONGBENCH_TASKS: tuple[str, ...] = tuple(DATASET2PROMPT)
LONGBENCH_E_TASKS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

V1_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
V2_FIELDS = (
    "_id", "domain", "sub_domain", "difficulty", "length", "question",
    "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context",
)  # fmt: skip

# LongBench v2 prompts/0shot.txt
V2_PROMPT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$"
    '\n\nFormat your response as follows: "The correct answer is (insert answer here)".'
)
V2_TASK = "longbench_v2"
V2_MAX_NEW_TOKENS = 128


def split_task(task: str) -> tuple[str, str, str | None]:
    """``(base task, version, v2 selector)`` from a task name: ``hotpotqa``, ``hotpotqa_e``, ``longbench_v2[:sel]``."""
    if task == V2_TASK or task.startswith(V2_TASK + ":"):
        selector = task[len(V2_TASK) + 1 :].strip() or None
        return V2_TASK, "v2", selector
    if task.endswith("_e") and task[:-2] in LONGBENCH_E_TASKS:
        return task[:-2], "e", None
    if task in DATASET2PROMPT:
        return task, "v1", None
    raise ValueError(
        f"unknown LongBench task {task!r}; known: {', '.join(LONGBENCH_TASKS)}; LongBench-E: <task>_e for "
        f"{', '.join(LONGBENCH_E_TASKS)}; v2: {V2_TASK} or {V2_TASK}:<domain or sub_domain>"
    )


def resolve_task(task: str, version: str | None) -> tuple[str, str, str | None, str]:
    """``(base, version, v2 selector, sample task name)`` for a task name plus an optional explicit version."""
    if version is None:
        base, version, selector = split_task(task)
    elif version not in ("v1", "e", "v2"):
        raise ValueError(f"unknown LongBench version {version!r}; use 'v1', 'e' or 'v2'")
    elif version == "v2":
        base, _, selector = split_task(task) if task.startswith(V2_TASK) else (V2_TASK, "v2", task)
    else:
        base, inferred, selector = split_task(task)
        if inferred == "v2":
            raise ValueError(f"task {task!r} is a LongBench v2 task but version={version!r}")
        if version == "e" and base not in LONGBENCH_E_TASKS:
            raise ValueError(f"{base!r} is not a LongBench-E task; LongBench-E has: {', '.join(LONGBENCH_E_TASKS)}")
    if version == "v2":
        name = V2_TASK if selector is None else f"{V2_TASK}:{selector}"
    else:
        name = f"{base}_e" if version == "e" else base
    return base, version, selector, name


def length_bin(length: int) -> str:
    """LongBench-E bin of a record's ``length`` field (words, not tokens): ``0-4k``, ``4-8k`` or ``8k+``."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"



def score_sample(task: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """Score one LongBench prediction on a 0-100 scale, as LongBench's ``eval.py`` does per sample.

    v1/E: first-line cut for trec/triviaqa/samsum/lsht, then ``100 * max`` over ``answers`` of the task's
    field metric (0-1). v2 (``longbench_v2[:...]``): 100 if the extracted choice equals ``answers[0]``,
    else 0. The task score is the mean over samples (LongBench rounds it to 2 decimals).
    """
    base = split_task(task)[0]
    if isinstance(answers, str) or not answers:
        raise ValueError("answers must be a non-empty list of strings")
    if base == V2_TASK:
        return multiple_choice_score(prediction, answers[0])
    if base in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[DATASET2METRIC[base]]
    return 100.0 * max(metric(prediction, gt, all_classes=all_classes) for gt in answers)
