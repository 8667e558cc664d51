"""memfit's predictor: analytic memory terms, features and the LightGBM model (see issue: predictor)."""
