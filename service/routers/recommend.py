"""``POST /recommend`` and ``POST /predict``: answers from the serving model, never touching the store."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import Histogram

from memfit.api import PredictRequest, PredictResponse, Recommendation, RecommendRequest
from service.deps import get_recommender
from service.errors import problem_responses
from service.recommender import Recommender

router = APIRouter(tags=["recommend"])

RECOMMENDED_K = Histogram(
    "memfit_recommended_k",
    "Recommended number of checkpointed layers",
    buckets=(0, 1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128),
)
PREDICTED_PEAK_GIB = Histogram(
    "memfit_predicted_peak_gib",
    "Predicted peak allocated memory at the recommended k",
    buckets=(1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 141, 192, 256, 512),
)


def _json(answer) -> Response:
    """The answer serialised once by pydantic's core (already validated: no second validation pass)."""
    return Response(answer.model_dump_json(), media_type="application/json")


@router.post("/recommend", response_model=Recommendation, responses=problem_responses(503))
def recommend(req: RecommendRequest, rec: Annotated[Recommender, Depends(get_recommender)]) -> Response:
    """Smallest k whose bounded peak fits, its layers, the curve over k; or the shortfall and alternatives."""
    out = rec.recommend(req)
    if out.k is not None:
        RECOMMENDED_K.observe(out.k)
    PREDICTED_PEAK_GIB.observe(out.predicted_peak_bytes / 2**30)
    return _json(out)


@router.post("/predict", response_model=PredictResponse, responses=problem_responses(503))
def predict(req: PredictRequest, rec: Annotated[Recommender, Depends(get_recommender)]) -> Response:
    """Peak, bound and breakdown for fully specified configurations (one booster call for the batch)."""
    return _json(
        PredictResponse(
            predictions=[rec.predict(item, i) for i, item in enumerate(req.items)], model_version=rec.version
        )
    )
