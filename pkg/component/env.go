package component

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/pflag"
)

// envAnnotation is the flag annotation that names a flag's environment
// variable. An annotation, not a map beside the flag set, so that any
// *pflag.FlagSet (cobra's too) can carry mirrors.
const envAnnotation = "gpudra.dev/env"

// EnvVar makes the environment variable env a second source of the flag
// name: it is used when the flag is not on the command line, and it is
// parsed by the flag's own Set, so a value the flag would refuse is refused
// (ApplyEnv). The flag's usage gets "(env ENV)". It panics when the flag does
// not exist: that is a mistake in the binary, not in its input.
func EnvVar(fs *pflag.FlagSet, name, env string) {
	f := fs.Lookup(name)
	if f == nil {
		panic(fmt.Sprintf("component.EnvVar: no flag --%s", name))
	}
	if err := fs.SetAnnotation(name, envAnnotation, []string{env}); err != nil {
		panic(err)
	}
	f.Usage += " (env " + env + ")"
}

// EnvOf is the environment variable of the flag name, or "".
func EnvOf(fs *pflag.FlagSet, name string) string {
	if f := fs.Lookup(name); f != nil && len(f.Annotations[envAnnotation]) > 0 {
		return f.Annotations[envAnnotation][0]
	}
	return ""
}

// ApplyEnv sets every flag that has an environment variable and was not on
// the command line (the command line wins) from that variable. A variable
// that is unset or empty leaves the default: the chart sets some variables
// to empty values, and an empty value meant "unset" before. A value the
// flag refuses is an error naming the variable, its value and the flag;
// every bad variable is reported, not only the first.
func ApplyEnv(fs *pflag.FlagSet, lookupEnv func(string) (string, bool)) error {
	var errs []error
	fs.VisitAll(func(f *pflag.Flag) {
		env := EnvOf(fs, f.Name)
		if env == "" || f.Changed {
			return
		}
		value, ok := lookupEnv(env)
		if !ok || value == "" {
			return
		}
		if err := fs.Set(f.Name, value); err != nil {
			// pflag's error repeats the value and names only the flag;
			// what the admin set is the variable.
			var invalid *pflag.InvalidValueError
			if errors.As(err, &invalid) && invalid.Unwrap() != nil {
				err = invalid.Unwrap()
			}
			errs = append(errs, fmt.Errorf("environment variable %s=%q (--%s): %w", env, value, f.Name, err))
		}
	})
	return errors.Join(errs...)
}

// Uint64ListVar defines a flag holding a comma-separated list of unsigned
// integers (spaces around items allowed). A value replaces the whole list:
// an empty value is an empty list, not the default.
func Uint64ListVar(fs *pflag.FlagSet, p *[]uint64, name string, def []uint64, usage string) {
	*p = slices.Clone(def)
	fs.Var(&uint64List{p: p}, name, usage)
}

type uint64List struct{ p *[]uint64 }

func (l *uint64List) Set(s string) error {
	// Not nil: an empty list is a choice ("none"), nil means the default
	// to those who read the value.
	out := []uint64{}
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		n, err := strconv.ParseUint(item, 10, 64)
		if err != nil {
			return fmt.Errorf("%q is not an unsigned integer", item)
		}
		out = append(out, n)
	}
	*l.p = out
	return nil
}

func (l *uint64List) String() string {
	if l.p == nil {
		return ""
	}
	items := make([]string, len(*l.p))
	for i, n := range *l.p {
		items[i] = strconv.FormatUint(n, 10)
	}
	return strings.Join(items, ",")
}

func (l *uint64List) Type() string { return "uints" }
