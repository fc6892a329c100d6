"""model_loader package."""
