// posenc/posenc.hpp — umbrella header: the core, the kernel and every encoding family.
// (posenc/io/* is separate: it needs nlohmann-json.)
#pragma once

#include "posenc/version.hpp"
#include "posenc/error.hpp"
#include "posenc/tensor.hpp"
#include "posenc/positions.hpp"
#include "posenc/encoding.hpp"
#include "posenc/options.hpp"
#include "posenc/reference.hpp"
#include "posenc/attention.hpp"

#include "posenc/sinusoidal.hpp"
#include "posenc/learned.hpp"
#include "posenc/rope.hpp"
#include "posenc/alibi.hpp"
#include "posenc/t5.hpp"
#include "posenc/shaw.hpp"
#include "posenc/transformer_xl.hpp"
#include "posenc/tupe.hpp"
#include "posenc/deberta.hpp"
