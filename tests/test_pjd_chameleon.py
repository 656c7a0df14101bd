"""``--method pjd`` on Chameleon-family targets (Lumina-mGPT's new-line tokens, Anole).

``ChameleonTarget.verify_grid`` gives a node at a row's last cell a new-line shadow; greedy PJD at
context = row length must equal AR on both layouts, and sampled PJD with rows open in parallel must
not depend on the batch. (The layouts, model and AR reference are conftest.py's, shared with
test_chameleon.py.)
"""

from __future__ import annotations

import pytest
import torch
from conftest import CHAMELEON_LAYOUTS, CHAMELEON_PROMPTS, LUMINA, chameleon_greedy_ar, chameleon_lm

from lantern.decoding.config import SamplingConfig
from lantern.decoding.loop import GenerationOutput, generate
from lantern.decoding.sampling import make_generators
from lantern.methods import MethodConfig
from lantern.targets.chameleon import encode_prompts
from lantern.testing import chameleon_parts


@pytest.mark.parametrize("layout", ["lumina", "anole"])
@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_chameleon_greedy_one_row_at_a_time_reproduces_ar(layout: str, cfg: float, batch: int) -> None:
    """Greedy PJD at context = row length equals AR on both layouts: on Lumina the row above's last
    code opens the next row as a root with its new-line shadow, which is committed with it."""
    lay = CHAMELEON_LAYOUTS[layout]
    prompts = CHAMELEON_PROMPTS[:batch]
    ids, mask = encode_prompts(prompts, lay)
    sampling = SamplingConfig(temperature=0.0, top_k=0, cfg_scale=cfg)
    lm = chameleon_lm()
    target, drafter = chameleon_parts(lm, lay, sampling, MethodConfig.resolve("pjd", pjd_window=2, pjd_context=3),
                                      None, lm.image_head)
    out = generate(target, ids, drafter=drafter, cond_mask=mask)
    assert torch.equal(out.codes, chameleon_greedy_ar(lay, cfg, prompts))


def test_chameleon_sampled_rows_independent_of_batch() -> None:
    """Sampled PJD with two rows open at once on the Lumina layout: codes do not depend on the batch."""
    lay, lm = LUMINA, chameleon_lm()
    sampling = SamplingConfig(temperature=1.0, top_k=8, cfg_scale=2.0)
    method = MethodConfig.resolve("pjd", pjd_window=2, pjd_context=1)

    def run(prompts: list[list[int]], seeds: list[int]) -> GenerationOutput:
        ids, mask = encode_prompts(prompts, lay)
        target, drafter = chameleon_parts(lm, lay, sampling, method, None, lm.image_head)
        return generate(target, ids, generators=make_generators(seeds), drafter=drafter, cond_mask=mask)

    together = run(CHAMELEON_PROMPTS, [1, 2, 3])
    assert bool((together.codes >= 0).all())
    assert int(together.stats.target_forwards.max()) < 9  # rows in parallel: fewer forwards than codes
    for i in range(3):
        alone = run(CHAMELEON_PROMPTS[i : i + 1], [i + 1])
        assert torch.equal(together.codes[i], alone.codes[0]), i
