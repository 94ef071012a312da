"""The model side: checkpoint loading (loader), one file per family (models/), the layers they are built from."""
