"""Integrations of fdpp into other libraries (:mod:`fdpp.integrations.hf`: Hugging Face transformers).
Imported on demand; fdpp itself never imports them."""
