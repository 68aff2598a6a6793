"""kfp declaration and glue of the train-tokenizer step (logic in ``step.py``, usage in ``README.md``).

The kfp function, ``components.kfp_functions.train_tokenizer``, is generated from :data:`COMPONENTS` (see
``components/declare.py``).
"""

from typing import Any

from components.declare import Component, settings_from_values
from components.tokenizer.step import TokenizerSettings, run_train_tokenizer

COMPONENTS = (Component(
    function="train_tokenizer",
    summary="Trains a byte-level BPE on the run's corpus (tokenizer_vocab_size > 0) or passes ``tokenizer`` on.",
    settings=TokenizerSettings,
    run="components.tokenizer.component:run",
    returns=("str", "The tokenizer spec that preprocess and pretrain use (the trained folder, or ``tokenizer``)."),
),)


def run(**values: Any) -> str:
    """The component's body."""
    return run_train_tokenizer(settings_from_values(TokenizerSettings, values))
