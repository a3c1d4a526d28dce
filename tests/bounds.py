"""Constants from the papers, each with its source. Tests import them from here only."""

import math

# TurboQuant paper, Theorem 1 and its table; survey "D_mse (numerical)". Exact Lloyd-Max cost of
# the Beta coordinate law at d = 128 (the papers round to 0.36 / 0.117 / 0.03 / 0.009).
TQ_MSE_D128 = {1: 0.3609, 2: 0.1160, 3: 0.0340, 4: 0.0093}
MSE_REL_TOL = 0.03  # measured MSE within 3 % of TQ_MSE_D128

# TurboQuant Theorem 1 upper bound and Theorem 3 lower bound (unit vectors).
def mse_upper(b: int) -> float:
    return math.sqrt(3) * math.pi / 2 * 4.0**-b


def mse_lower(b: int) -> float:
    return 4.0**-b


# TurboQuant-prod inner-product variance * d for ||q|| = 1 (survey table "D_prod (numerical)",
# 1.57 / 0.56 / 0.18 / 0.047); these hold for i.i.d. Gaussian QJL matrices. Issue #2 rounds them
# to 1.56 / 0.56 / 0.18 / 0.05 with a 10 % tolerance.
TQ_PROD_VAR_D = {1: 1.56, 2: 0.56, 3: 0.18, 4: 0.05}
PROD_VAR_REL_TOL = 0.10

# QJL paper, Lemma 3.2 (unbiasedness): mean error within this many standard errors of 0.
UNBIASED_Z = 4.0

# Gaussian Lloyd-Max (Max 1960) MSE per unit variance, the d -> infinity limit.
GAUSS_LLOYD_MAX = {1: 1 - 2 / math.pi, 2: 0.11748, 3: 0.03455, 4: 0.00950}

# Our derivation (tests/test_turbo.py): with an orthogonalized QJL matrix of m = d rows the
# residual sketch behaves like a 1-bit quantizer with the unbiased scale, whose error variance is
# Var(sqrt(pi/2)|g|) = pi/2 - 1 per unit of ||r||^2 / d; so var * d ~ (pi/2 - 1) * D_mse(b-1),
# ~2.75x below the Gaussian-matrix figures above (pi/2 * D_mse(b-1)).
ORTHO_PROD_FACTOR = math.pi / 2 - 1
GAUSS_PROD_FACTOR = math.pi / 2
