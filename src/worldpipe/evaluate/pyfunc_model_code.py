"""Model code MLflow copies into every logged world model and runs when the model is loaded.

MLflow's "models from code": the logged model holds this file instead of a pickled object, so loading one
runs only this import of the installed ``worldpipe`` package. Not meant to be imported otherwise.
"""

from mlflow.models import set_model

from worldpipe.evaluate.logged_model import OpenLoopPredictor

set_model(OpenLoopPredictor())
