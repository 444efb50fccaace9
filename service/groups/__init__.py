"""Groups: how ranks meet and form one, its members and state, adoption by a later daemon."""
