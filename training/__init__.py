"""Pretraining of SwitchHead / SwitchAll models and their dense baselines with Accelerate (`switchhead train`)."""

from .data import TokenBatches, load_documents, load_tokenizer, stdlib_documents, tokenize_documents, train_tokenizer
from .checkpoint_files import checkpoint_dirs
from .paper import PAPER_TRAINING
from .trainer import TINY_TRAINING, TrainingConfig, TrainingError, TrainResult, learning_rate_at, train

__all__ = ["PAPER_TRAINING", "TINY_TRAINING", "TokenBatches", "TrainResult", "TrainingConfig", "TrainingError",
           "checkpoint_dirs", "learning_rate_at", "load_documents", "load_tokenizer", "stdlib_documents", "tokenize_documents",
           "train", "train_tokenizer"]
