"""`python -m nodecomm.service`: nodecommd."""

import sys

from nodecomm.service.daemon import main

sys.exit(main())
