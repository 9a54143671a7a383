# Generates the golden-case parity tests when ctest runs (included through TEST_INCLUDE_FILES by the
# file tests/parity.cmake writes). Inputs: POSENC_RUN (the built posenc-run), POSENC_PARITY_DATA
# (tests/data). Runs in ctest's script context: add_test(<name> <command> <args>...).
#
# For each tests/data/*.json whose `kind` is a row of `posenc-run --list-kinds`:
#   parity.<case>.f64, parity.<case>.f32     always
#   parity.<case>.threads2                   kinds whose second column is `attention`
#   parity.<case>.hf_float32                 kinds listing the hf_float32 variant
# A case of a kind posenc-run does not know is registered as a disabled test, so ctest lists it under
# "did not run" instead of dropping it silently.

# ctest reads this with no policy settings (CMP0057: IN_LIST): set them for this file only.
cmake_policy(PUSH)
cmake_policy(VERSION 3.25)

function(_posenc_parity_tests)
  if(NOT EXISTS "${POSENC_RUN}")
    # Not built yet: one failing test says so (running it fails: the program does not exist).
    add_test(parity.posenc-run_not_built "${POSENC_RUN}" --list-kinds)
    set_tests_properties(parity.posenc-run_not_built PROPERTIES LABELS parity)
    return()
  endif()

  execute_process(COMMAND "${POSENC_RUN}" --list-kinds OUTPUT_VARIABLE _kinds_out ERROR_VARIABLE _kinds_err
                  RESULT_VARIABLE _kinds_rc)
  if(NOT _kinds_rc EQUAL 0)
    add_test(parity.list_kinds_failed "${POSENC_RUN}" --list-kinds)
    set_tests_properties(parity.list_kinds_failed PROPERTIES LABELS parity)
    return()
  endif()

  string(REPLACE "\n" ";" _rows "${_kinds_out}")
  set(_known)
  foreach(_row IN LISTS _rows)
    string(REGEX MATCHALL "[^ \t]+" _cols "${_row}")
    list(LENGTH _cols _n)
    if(_n EQUAL 0)
      continue()
    endif()
    list(GET _cols 0 _kind)
    list(APPEND _known ${_kind})
    set(_attention_${_kind} FALSE)
    set(_variants_${_kind})
    if(_n GREATER 1)
      list(GET _cols 1 _c)
      if(_c STREQUAL "attention")
        set(_attention_${_kind} TRUE)
      endif()
    endif()
    if(_n GREATER 2)
      list(GET _cols 2 _c)
      if(NOT _c STREQUAL "-")
        string(REPLACE "," ";" _variants_${_kind} "${_c}")
      endif()
    endif()
  endforeach()

  file(GLOB _cases "${POSENC_PARITY_DATA}/*.json")
  list(SORT _cases)
  foreach(_case IN LISTS _cases)
    file(READ "${_case}" _text)
    string(JSON _kind ERROR_VARIABLE _err GET "${_text}" kind)
    if(_err)
      continue()  # not a golden case (no `kind`)
    endif()
    # The file's stem (NAME_WE would stop at the first dot of rope_partial_0.4_...).
    get_filename_component(_name "${_case}" NAME)
    string(REGEX REPLACE "\\.json$" "" _name "${_name}")
    if(NOT _kind IN_LIST _known)
      add_test(parity.${_name} "${POSENC_RUN}" --check "${_case}")
      set_tests_properties(parity.${_name} PROPERTIES LABELS parity DISABLED TRUE)
      continue()
    endif()
    foreach(_dtype f64 f32)
      add_test(parity.${_name}.${_dtype} "${POSENC_RUN}" --check --dtype ${_dtype} "${_case}")
      set_tests_properties(parity.${_name}.${_dtype} PROPERTIES LABELS parity)
    endforeach()
    if(_attention_${_kind})
      add_test(parity.${_name}.threads2 "${POSENC_RUN}" --check --threads 2 "${_case}")
      set_tests_properties(parity.${_name}.threads2 PROPERTIES LABELS parity)
    endif()
    foreach(_variant IN LISTS _variants_${_kind})
      if(_variant STREQUAL "hf_float32")
        # The HF float32 emulation: compares the *_hf_float32 expectations.
        add_test(parity.${_name}.hf_float32 "${POSENC_RUN}" --check --dtype f32 --rope-angles hf_float32 "${_case}")
        set_tests_properties(parity.${_name}.hf_float32 PROPERTIES LABELS parity)
      else()
        add_test(parity.${_name}.unknown_variant_${_variant} "${POSENC_RUN}" --no-such-variant ${_variant})
        set_tests_properties(parity.${_name}.unknown_variant_${_variant} PROPERTIES LABELS parity)
      endif()
    endforeach()
  endforeach()
endfunction()

_posenc_parity_tests()
cmake_policy(POP)
