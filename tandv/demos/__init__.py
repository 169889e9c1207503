"""Runnable demos: ``tandv demo`` trains a small transformer and tracks it."""
