"""NaN and inf named as such: a check that compares tensors says first that your result
holds NaN or inf, and what usually puts it there, before the largest difference (which is
then only "nan").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_SUBTRACTION = (
    "exp of scores whose max was not subtracted first (a softmax, or an online softmax's "
    "running max): exp overflows to inf past a score of about 88 (exp2 past 128), and "
    "inf / inf is NaN"
)
MASKED_ROW = (
    "a fully masked row: every score -inf, so its max is -inf and -inf - (-inf) is NaN, or "
    "its sum is 0 and 0 / 0 is NaN; keep the row's sum above 0 or skip it"
)
ZERO_DIVISOR = (
    "a division by a sum or a norm that is 0 (a row of zeros, a distribution with no mass "
    "left, a missing eps): 0 / 0 is NaN, x / 0 is inf"
)
LOG_OF_ZERO = "the log of 0 (-inf), carried into a sum or a product"
USUAL_CAUSES = (MAX_SUBTRACTION, MASKED_ROW, ZERO_DIVISOR, LOG_OF_ZERO)


def nonfinite_note(got: object, causes: Sequence[str] = USUAL_CAUSES) -> str:
    """How many values of `got` are NaN or inf, and the causes to look for, most likely
    first; "" when `got` is not a float tensor or every value in it is finite."""
    if not isinstance(got, torch.Tensor) or not got.is_floating_point():
        return ""
    nan, inf = int(got.isnan().sum()), int(got.isinf().sum())
    if not nan and not inf:
        return ""
    counts = " and ".join(f"{what} in {n}" for what, n in (("NaN", nan), ("inf", inf)) if n)
    listed = "".join(f"\n  - {cause}" for cause in causes)
    return f"your result holds {counts} of its {got.numel()} values; look for{listed}"


def lead_with_nonfinite(got: object, message: str, causes: Sequence[str] = USUAL_CAUSES) -> str:
    """`message`, led by `nonfinite_note(got, causes)` on a line of its own when there is one."""
    note = nonfinite_note(got, causes)
    return f"{note}\n{message}" if note else message
