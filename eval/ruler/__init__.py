"""RULER synthetic long-context tasks, generated offline and sized with the model's tokenizer.

Follows the recipes of NVIDIA/RULER (``scripts/synthetic.yaml`` and ``scripts/data/synthetic/*``): the 13
tasks, their prompt templates and answer prefixes, ``tokens_to_generate`` budgets and metrics. Each sample's
``input`` is the exact text the model receives: (chat template, when asked) + task text + answer prefix.
``length`` is its token count measured with the given tokenizer (``add_special_tokens`` as recorded in the
sample: True without a chat template, False with one, because the rendered chat template already carries its
special tokens), and ``length + max_new_tokens <= max_length``.

Haystacks: every task has RULER's default haystack (``TASKS[task].haystack``). The ``haystack``
argument of :func:`generate_samples` overrides it only for tasks whose default is ``noise`` or
``essay`` (niah_single_1/2/3, niah_multikey_1, niah_multivalue, niah_multiquery, vt); for the others
(niah_multikey_2/3 use distractor needles, cwe/fwe/qa have their own material) it is ignored and the
sample records the haystack actually used. ``"needle"`` is accepted for NIAH tasks only.

Known, deliberate deviations from RULER (samples are *not* byte-identical to RULER's):

* Randomness: every sample has its own ``random.Random`` seeded from ``(seed, task, index)`` and all
  random draws happen before sizing, so a sample's keys/values do not depend on the haystack size and
  the same seed always gives the same samples.
* Needle depth: the answer needle of sample ``i`` is placed at depth ``i / (num_samples - 1)`` (evenly
  spread over [0, 1]; 0.5 for a single sample); the other needles of multi-needle tasks get uniform
  random depths. RULER draws all positions at random. Depth is measured in haystack units (noise
  units, distractor needles, or essay sentences).
* Word keys are ``adjective-noun`` drawn as one adjective and one noun from wonderwords' lists
  (same distribution as RULER's ``random.choice`` over the 6.2M sorted combinations, without building it).
* Essay sentences are split with a small built-in rule-based splitter (NLTK's punkt model is not
  available offline).
* Few-shot examples (vt, cwe) are placed inside the user turn, before the task text, never inside a
  second copy of the chat template; vt's example uses a fixed 15 noise units.
* The ``q * v == 1`` singular rewrites (``Some->A``, ``are->is``...) are applied to RULER's task
  template only, never to the model's chat template.
* cwe beyond the 8,166-word wonderwords pool (about 128K tokens) is extended with extra
  ``adjective-noun`` words instead of RULER's unavailable ``randle`` list.

Modules: :mod:`.tasks` (the task table and RULER's verbatim texts), :mod:`.essays` (the essay haystack),
:mod:`.draws` (random keys, values and words), :mod:`.draft` (what a task generator returns), one module per task
family (:mod:`.niah`, :mod:`.vt`, :mod:`.aggregation` for cwe/fwe, :mod:`.qa`), :mod:`.sizing` (fitting a
prompt to a token budget) and :mod:`.generate` (:func:`generate_samples`, :func:`min_length`, saving and loading).
"""

from hf_sparse_attn.eval.ruler.essays import essay_names, essay_texts, haystack_essays
from hf_sparse_attn.eval.ruler.generate import generate_samples, load_samples, min_length, save_samples
from hf_sparse_attn.eval.ruler.tasks import (
    CWE_ANSWER_PREFIX,
    CWE_TEMPLATE,
    FWE_ANSWER_PREFIX,
    FWE_TEMPLATE,
    NEEDLE,
    NIAH_ANSWER_PREFIX,
    NIAH_TEMPLATE,
    NOISE_UNIT,
    QA_ANSWER_PREFIX,
    QA_TEMPLATE,
    TASKS,
    VT_ANSWER_PREFIX,
    VT_TEMPLATE,
    TaskConfig,
    TaskDataMissing,
)

__all__ = [
    "CWE_ANSWER_PREFIX",
    "CWE_TEMPLATE",
    "FWE_ANSWER_PREFIX",
    "FWE_TEMPLATE",
    "NEEDLE",
    "NIAH_ANSWER_PREFIX",
    "NIAH_TEMPLATE",
    "NOISE_UNIT",
    "QA_ANSWER_PREFIX",
    "QA_TEMPLATE",
    "TASKS",
    "VT_ANSWER_PREFIX",
    "VT_TEMPLATE",
    "TaskConfig",
    "TaskDataMissing",
    "essay_names",
    "essay_texts",
    "generate_samples",
    "haystack_essays",
    "load_samples",
    "min_length",
    "save_samples",
]
